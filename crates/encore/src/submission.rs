//! Submissions: committed work the host can wait on, poll and time.
//!
//! A submission holds every allocation and kernel bound into it until its
//! completion has been observed (invariant 1). Dropping an unfinished
//! submission hands that duty to its device, which releases the resources
//! when it next sees the work complete and reports any error from it at the
//! next commit or synchronization, so no failure is lost.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::backend::Timing;
use crate::counters::Counters;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::program::Program;
use crate::retain::{InFlight, Retained};
use crate::Label;

enum State {
    Running(InFlight),
    Done {
        timing: Option<Timing>,
        program: Arc<Program>,
        error: Option<String>,
    },
}

impl Device {
    /// Submits a recorded program.
    pub(crate) fn submit(
        &self,
        program: Program,
        retained: Retained,
        mut counts: Counters,
        label: Label,
    ) -> Result<Submission> {
        self.before_submit()?;
        counts.submissions = 1;
        self.add_counters(&counts);
        let program = Arc::new(program);
        let backend =
            self.backend()
                .submit(program.clone(), Vec::new(), self.profiles_dispatches())?;
        Ok(Submission::new(
            self.clone(),
            label,
            InFlight {
                backend,
                retained,
                program,
                replay: None,
            },
        ))
    }
}

/// Work committed to a device.
pub struct Submission {
    device: Device,
    label: Label,
    state: Mutex<Option<State>>,
}

impl Submission {
    pub(crate) fn new(device: Device, label: Label, in_flight: InFlight) -> Submission {
        Submission {
            device,
            label,
            state: Mutex::new(Some(State::Running(in_flight))),
        }
    }

    /// The label given to the encoder when this was committed.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The device the work runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Blocks until the work completes. A failure inside any dispatch comes
    /// back here as a typed error; later calls report it again.
    pub fn wait(&self) -> Result<()> {
        let mut state = self.state.lock();
        if !matches!(*state, Some(State::Running(_))) {
            return self.previous_outcome(&state);
        }
        if let Some(State::Running(in_flight)) = state.take() {
            self.device.count_wait();
            let outcome = in_flight.backend.wait();
            *state = Some(self.finish(in_flight, outcome.as_ref().ok().cloned()));
            if let Err(e) = outcome {
                self.remember(&mut state, &e);
                return Err(e);
            }
        }
        self.previous_outcome(&state)
    }

    /// Whether the work has completed (successfully or not). Observing
    /// completion releases what the submission retained.
    pub fn is_complete(&self) -> bool {
        let mut state = self.state.lock();
        match state.take() {
            Some(State::Running(in_flight)) => match in_flight.backend.poll() {
                None => {
                    *state = Some(State::Running(in_flight));
                    false
                }
                Some(outcome) => {
                    *state = Some(self.finish(in_flight, outcome.as_ref().ok().cloned()));
                    if let Err(e) = outcome {
                        self.remember(&mut state, &e);
                    }
                    true
                }
            },
            other => {
                *state = other;
                true
            }
        }
    }

    /// Device time of the whole submission, once complete.
    pub fn elapsed(&self) -> Option<Duration> {
        match &*self.state.lock() {
            Some(State::Done {
                timing: Some(t), ..
            }) => Some(t.elapsed),
            _ => None,
        }
    }

    /// Device time of each dispatch with its label and kernel, once complete,
    /// when the device profiles dispatches.
    pub fn dispatch_times(&self) -> Option<Vec<DispatchTime>> {
        match &*self.state.lock() {
            Some(State::Done {
                timing: Some(t),
                program,
                ..
            }) if !t.dispatches.is_empty() => Some(
                program
                    .dispatches
                    .iter()
                    .zip(&t.dispatches)
                    .map(|(d, &time)| DispatchTime {
                        label: d.label.clone(),
                        kernel: d.kernel.name().to_string(),
                        op: d.kernel.op_kind().to_string(),
                        time,
                    })
                    .collect(),
            ),
            _ => None,
        }
    }

    fn finish(&self, in_flight: InFlight, timing: Option<Timing>) -> State {
        self.device
            .observe_completion(&self.label, &in_flight, timing.as_ref());
        let InFlight {
            retained, program, ..
        } = in_flight;
        drop(retained);
        State::Done {
            timing,
            program,
            error: None,
        }
    }

    fn remember(&self, state: &mut Option<State>, e: &Error) {
        if let Some(State::Done { error, .. }) = state {
            *error = Some(e.to_string());
        }
    }

    fn previous_outcome(&self, state: &Option<State>) -> Result<()> {
        match state {
            Some(State::Done {
                error: Some(message),
                ..
            }) => Err(Error::KernelFailed {
                kernel: "(reported earlier)".into(),
                label: self.label.to_string(),
                message: message.clone(),
            }),
            _ => Ok(()),
        }
    }
}

impl Drop for Submission {
    fn drop(&mut self) {
        if let Some(State::Running(in_flight)) = self.state.get_mut().take() {
            self.device.adopt(in_flight, self.label.clone());
        }
    }
}

/// Device time of one dispatch.
#[derive(Clone, Debug)]
pub struct DispatchTime {
    pub label: Label,
    pub kernel: String,
    pub op: String,
    pub time: Duration,
}
