//! Comparing a GPU session with a CPU session of the same model: logits
//! errors, near-ties, and decoding that feeds both the CPU's tokens.

#![allow(dead_code)]

use encore_llm::sampler::greedy;
use encore_llm::Session;

/// Free-running greedy decoding of `steps` tokens after `first`, through
/// the self-feeding graph (`Session::decode_greedy`), as `generate` runs it.
pub fn greedy_tokens(session: &mut Session, first: u32, steps: usize) -> Vec<u32> {
    let mut tokens = Vec::new();
    session
        .decode_greedy(first, steps, 4, |t| {
            tokens.push(t);
            Ok(true)
        })
        .unwrap();
    tokens
}

/// `max |a - b|` relative to `max |b|`.
pub fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    assert!(a.iter().all(|v| v.is_finite()), "non-finite logits");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// The gap between the best and the second-best logit, relative to the largest magnitude.
pub fn margin(logits: &[f32]) -> f32 {
    let best = greedy(logits) as usize;
    let second = logits
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != best)
        .fold(f32::NEG_INFINITY, |m, (_, v)| m.max(*v));
    let scale = logits.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    (logits[best] - second) / scale
}

/// What [`follow_cpu`] saw.
pub struct Following {
    /// Steps at which the GPU's greedy token was the CPU's.
    pub agreed: usize,
    /// Steps at which it was not, each at a near-tie in the CPU's logits.
    pub close_calls: usize,
    /// The largest logits relative error over the steps.
    pub worst: f32,
}

/// Decodes `steps` tokens in every session (the CPU's first), each fed the
/// CPU's greedy choice (teacher forcing), so that one near-tie cannot send
/// the devices down different paths; starts from `token`. At every step the
/// logits of the GPU session (the second) must be within `tolerance` of
/// the CPU's, every session's device argmax must be its host greedy choice,
/// and the GPU may pick another token only where the CPU's best two logits
/// are within twice the tolerance. `check` sees every step's logits of all
/// sessions.
pub fn follow_cpu(
    sessions: &mut [Session],
    mut token: u32,
    steps: usize,
    tolerance: f32,
    mut check: impl FnMut(usize, &[Vec<f32>]),
) -> Following {
    let mut f = Following {
        agreed: 0,
        close_calls: 0,
        worst: 0.0,
    };
    for step in 0..steps {
        for s in sessions.iter_mut() {
            s.step(token).unwrap();
        }
        let l: Vec<Vec<f32>> = sessions.iter().map(|s| s.logits().unwrap()).collect();
        let err = relative_error(&l[1], &l[0]);
        f.worst = f.worst.max(err);
        assert!(err <= tolerance, "step {step}: logits differ by {err:.2e}");
        check(step, &l);
        for (s, l) in sessions.iter().zip(&l) {
            assert_eq!(s.argmax().unwrap(), greedy(l), "step {step}: device argmax");
        }
        let (want, got) = (greedy(&l[0]), greedy(&l[1]));
        if want == got {
            f.agreed += 1;
        } else {
            f.close_calls += 1;
            assert!(
                margin(&l[0]) <= 2.0 * tolerance,
                "step {step}: the GPU picked {got}, the CPU {want} with a clear margin {:.2e}",
                margin(&l[0])
            );
        }
        token = want;
    }
    f
}
