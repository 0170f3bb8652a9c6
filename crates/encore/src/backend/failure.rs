//! A device's first failure. Once something leaves a device in doubt (it
//! was lost, ran out of memory, hit an internal error), the device refuses
//! further work, naming that first cause; later failures keep it.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// The first failure of a device, shared by its backend, its in-flight work
/// and the driver's callbacks.
#[derive(Clone, Default)]
pub(crate) struct Failure(Arc<Mutex<Option<String>>>);

impl Failure {
    /// Records `cause` unless the device failed before; `true` when it is
    /// the first.
    pub(crate) fn record(&self, cause: &str) -> bool {
        let mut first = self.0.lock();
        if first.is_some() {
            return false;
        }
        *first = Some(cause.to_string());
        true
    }

    /// The first failure's cause, once the device has failed.
    pub(crate) fn cause(&self) -> Option<String> {
        self.0.lock().clone()
    }

    /// `Err` naming `device` and the cause once the device has failed.
    pub(crate) fn check(&self, device: &str) -> Result<()> {
        match self.cause() {
            Some(cause) => Err(Error::DeviceFailed {
                device: device.to_string(),
                cause,
            }),
            None => Ok(()),
        }
    }
}
