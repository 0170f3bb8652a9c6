//! Token sampling: greedy, temperature, top-k, top-p, min-p, repeat penalty.
//!
//! Filters apply in llama.cpp's order: repeat penalty on the raw logits, then
//! top-k, top-p, min-p, temperature, and a draw from the remaining
//! distribution. Temperature 0 means greedy (argmax of the penalized logits).

/// Sampling settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    /// 1.0 disables.
    pub repeat_penalty: f32,
    /// How many recent tokens the repeat penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> SamplerConfig {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0x5eed,
        }
    }
}

impl SamplerConfig {
    /// Whether the choice is the argmax of the logits (no penalty, no randomness),
    /// so a device-side argmax can stand in for host sampling.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature <= 0.0 && self.repeat_penalty == 1.0
    }
}

/// A sampler with its random state.
pub struct Sampler {
    config: SamplerConfig,
    rng: u64,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Sampler {
        // splitmix64 of the seed, so nearby seeds diverge.
        let rng = config.seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        Sampler { config, rng }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    fn next_f32(&mut self) -> f32 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Picks the next token from `logits` given the tokens so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let c = self.config.clone();
        let mut logits = logits.to_vec();
        if c.repeat_penalty != 1.0 && c.repeat_penalty > 0.0 {
            let start = history.len().saturating_sub(c.repeat_last_n);
            let mut seen = std::collections::HashSet::new();
            for &t in &history[start..] {
                if let (true, Some(l)) = (seen.insert(t), logits.get_mut(t as usize)) {
                    *l = if *l > 0.0 {
                        *l / c.repeat_penalty
                    } else {
                        *l * c.repeat_penalty
                    };
                }
            }
        }
        if c.temperature <= 0.0 {
            return greedy(&logits);
        }
        // Candidates sorted by logit, descending (ties by id for determinism).
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l))
            .collect();
        if cand.is_empty() {
            return 0;
        }
        let keep = if c.top_k > 0 {
            c.top_k.min(cand.len())
        } else {
            cand.len()
        };
        if keep < cand.len() {
            cand.select_nth_unstable_by(keep - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            cand.truncate(keep);
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let probs = softmax(&cand, 1.0);
        if c.top_p < 1.0 {
            let mut cum = 0.0;
            let mut n = cand.len();
            for (i, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= c.top_p {
                    n = i + 1;
                    break;
                }
            }
            cand.truncate(n.max(1));
        }
        if c.min_p > 0.0 {
            let probs = softmax(&cand, 1.0);
            let threshold = probs[0] * c.min_p;
            let n = probs.iter().take_while(|&&p| p >= threshold).count();
            cand.truncate(n.max(1));
        }
        let probs = softmax(&cand, c.temperature);
        let r = self.next_f32();
        let mut cum = 0.0;
        for (p, (id, _)) in probs.iter().zip(&cand) {
            cum += p;
            if r < cum {
                return *id;
            }
        }
        cand.last().map_or(0, |c| c.0)
    }
}

/// The index of the largest logit (the first among equals).
pub fn greedy(logits: &[f32]) -> u32 {
    encore_ops::cpu::kernels::argmax::argmax(logits)
}

fn softmax(cand: &[(u32, f32)], temperature: f32) -> Vec<f32> {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = cand
        .iter()
        .map(|c| ((c.1 - max) / temperature).exp())
        .collect();
    let sum: f32 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.5, -1.0, 0.5, 2.9]
    }

    #[test]
    fn temperature_zero_is_argmax() {
        let mut s = Sampler::new(SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&logits(), &[]), 1);
    }

    #[test]
    fn repeat_penalty_demotes_recent_tokens() {
        let mut s = Sampler::new(SamplerConfig {
            temperature: 0.0,
            repeat_penalty: 1.5,
            ..Default::default()
        });
        // 3.0 / 1.5 = 2.0 < 2.9
        assert_eq!(s.sample(&logits(), &[1]), 5);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplerConfig {
            temperature: 5.0,
            top_k: 1,
            ..Default::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&logits(), &[]), 1);
        }
    }

    #[test]
    fn top_p_and_min_p_restrict_the_candidates() {
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            min_p: 0.0,
            ..Default::default()
        });
        for _ in 0..200 {
            let t = s.sample(&logits(), &[]);
            assert!(t == 1 || t == 5, "{t}");
        }
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.5,
            ..Default::default()
        });
        for _ in 0..200 {
            let t = s.sample(&logits(), &[]);
            assert!([1, 2, 5].contains(&t), "{t}");
        }
    }

    #[test]
    fn same_seed_same_draws_and_all_candidates_reachable() {
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        };
        let draws = |seed| {
            let mut s = Sampler::new(SamplerConfig {
                seed,
                ..cfg.clone()
            });
            (0..300)
                .map(|_| s.sample(&logits(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(7), draws(7));
        assert_ne!(draws(7), draws(8));
        let seen: std::collections::HashSet<u32> = draws(7).into_iter().collect();
        assert!(seen.len() >= 4, "{seen:?}");
    }
}
