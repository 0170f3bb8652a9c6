//! Elementwise ops, norms, RoPE, KV stores, argmax and the position advance.

use super::common::{upload, Rng};
use super::{assert_close, both, run};

/// `add` over lengths that do and do not fill a workgroup: exact (one f32
/// addition per element).
#[test]
fn add_matches_cpu() {
    let mut rng = Rng::new();
    for n in [1usize, 255, 256, 1000, 70_000] {
        let (y0, x) = (rng.vec(n), rng.vec(n));
        let out = both().map(|ops| {
            let (y, xb) = (upload(&ops, &y0), upload(&ops, &x));
            run(&ops, |o, e| o.add(e, &y, &xb, n));
            y.download::<f32>().unwrap()
        });
        assert_close(&format!("add n={n}"), &out[1], &out[0], 0.0, 0.0);
    }
}
