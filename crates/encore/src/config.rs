//! The one configuration surface of Encore.
//!
//! Every switch of the runtime lives in [`Config`]. Programs build it with
//! [`Config::from_env`], which starts from the defaults and applies these
//! environment overrides. This table lists every `ENCORE_*` variable of the
//! project: the last two belong to the layers above the runtime (the kernel
//! set is the op layer's choice, graphs the engine's) and are read by
//! `encore_llm::EngineOptions::from_env` with [`flag`]. Nothing else reads
//! the environment (except the CUDA backend's NVTX loader, for the variable
//! through which a profiling tool names itself, below).
//!
//! | variable | field | values | default |
//! | --- | --- | --- | --- |
//! | `ENCORE_DEVICE` | [`Config::device`] | the device `auto` opens: `auto`, `cpu`, `cuda`, `cuda:N`, `metal`, `wgpu`, `wgpu:N` | `auto` |
//! | `ENCORE_THREADS` | [`Config::threads`] | CPU worker threads, `0` = one per core, at most [`max_threads`] (8 per core: more only costs memory and switches) | `0` |
//! | `ENCORE_SERIAL` | [`Config::serial`] | `1` puts a barrier after every dispatch | `0` |
//! | `ENCORE_FUSION` | [`Config::fusion`] | `0` disables the graph fusion pass | `1` |
//! | `ENCORE_SCHEDULE` | [`Config::schedule`] | `0` keeps recording order instead of scheduling | `1` |
//! | `ENCORE_EARLY_LAUNCH` | [`Config::early_launch`] | `0` makes every graph edge wait for full completion | `1` |
//! | `ENCORE_SPECIALIZE` | [`Config::specialize`] | `0` keeps graph nodes on their kernels' generic code | `1` |
//! | `ENCORE_SUBGROUPS` | [`Config::subgroups`] | `0` keeps wgpu kernels on their versions without subgroup operations | `1` |
//! | `ENCORE_SHADER_F16` | [`Config::shader_f16`] | `0` keeps wgpu kernels on their versions without f16 arithmetic | `1` |
//! | `ENCORE_PROFILE` | [`Config::profile`] | `off`, `counters`, `submissions`, `dispatches` | `off` |
//! | `ENCORE_CACHE_DIR` | [`Config::cache_dir`] | directory for compiled kernels and fetched models | the user cache dir + `/encore` |
//! | `ENCORE_CAPTURE` | [`Config::capture`] | path of a one-shot trace capture; on CUDA also a profiler range and NVTX ranges, on Metal a `.gputrace` path gets a GPU trace document (below) | unset |
//! | `ENCORE_CAPTURE_AT` | [`Config::capture_at`] | which graph replay to capture, `1` to `18446744073709551615` | `1` |
//! | `ENCORE_AMX` | read by `encore-ops` once per process | `0` keeps the CPU's products of several rows of the super-block types (K-quants, IQ4_XS) off AMX tiles, on the AVX-512 VNNI ones | on where the CPU has AMX-INT8 and Linux grants it |
//! | `ENCORE_EXACT` | `encore_llm::EngineOptions::kernels` | `1` loads the exact kernel set: GPU kernels compute the CPU backend's results bit for bit, slower | `0` |
//! | `ENCORE_GRAPHS` | `encore_llm::EngineOptions::graphs` | `0` runs decode steps eagerly instead of replaying graphs | `1` |
//!
//! A value outside its range is an error naming the variable and the range,
//! never clamped.
//!
//! The one-shot capture writes the chosen graph replay (a decode step) as a
//! Chrome trace. On CUDA that replay also runs inside a CUDA profiler range
//! (`cuProfilerStart`/`cuProfilerStop`) and an NVTX range named
//! `encore graph replay N`, with one nested NVTX range per dispatch named by
//! its kernel and label (`matmul attn_q`), in the NVTX domain `encore`. So
//! Nsight Systems records exactly that step:
//!
//! ```text
//! ENCORE_CAPTURE=step.json ENCORE_CAPTURE_AT=3 \
//!   nsys profile --capture-range=cudaProfilerApi --trace=cuda,nvtx -o step \
//!   encore generate ...
//! nsys stats --report nvtx_sum,cuda_gpu_kern_sum step.nsys-rep
//! ```
//!
//! and Nsight Compute profiles only its kernels with
//! `ncu --profile-from-start off --nvtx`. The NVTX tool is found the way
//! NVTX itself finds it, through `NVTX_INJECTION64_PATH`, which these tools
//! set; that variable is theirs, not an Encore setting.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// How much the runtime measures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum ProfileMode {
    /// Counters only (they are always on).
    #[default]
    Off,
    /// Counters, reported at exit.
    Counters,
    /// Counters and device time per submission label.
    Submissions,
    /// All of the above and device time per dispatch.
    Dispatches,
}

impl ProfileMode {
    /// Parses `off`, `counters`, `submissions` or `dispatches`.
    pub fn parse(s: &str) -> Option<ProfileMode> {
        match s {
            "" | "0" | "off" | "none" => Some(ProfileMode::Off),
            "counters" => Some(ProfileMode::Counters),
            "submissions" => Some(ProfileMode::Submissions),
            "1" | "dispatches" => Some(ProfileMode::Dispatches),
            _ => None,
        }
    }
}

/// Encore's behaviour switches. See the module docs for the environment overrides.
#[derive(Clone, Debug)]
pub struct Config {
    /// The device [`crate::Device::open`] opens for `auto`: `auto` (CUDA
    /// when there is a GPU, else Metal on Apple platforms, else a hardware
    /// wgpu adapter, else the CPU), or a device name (`cpu`, `cuda:N`,
    /// `metal`, `wgpu:N`).
    pub device: String,
    /// CPU worker threads; 0 means one per available core. At most
    /// [`max_threads`] when read from the environment.
    pub threads: usize,
    /// Put a barrier after every dispatch (debugging hazards).
    pub serial: bool,
    /// Run the graph fusion pass.
    pub fusion: bool,
    /// Run the graph scheduling pass.
    pub schedule: bool,
    /// Let CUDA graphs start a kernel declared programmatic while the
    /// kernels it depends on finish (programmatic dependent launch, sm_90
    /// and later; ignored elsewhere).
    pub early_launch: bool,
    /// Give graph nodes of kernels with variants on the device's backend
    /// ([`crate::KernelDef::specialized_for`]: CUDA's specializable
    /// kernels, wgpu's with [`crate::KernelDef::wgpu_variants`]) the
    /// variant compiled for their shape.
    pub specialize: bool,
    /// Let the wgpu backend compile a kernel's version with subgroup
    /// operations ([`crate::WgpuKernel::with_version`]) where the adapter
    /// offers them.
    pub subgroups: bool,
    /// Let the wgpu backend compile a kernel's version with f16 arithmetic
    /// ([`crate::WgpuKernel::with_version`]) where the adapter offers it.
    pub shader_f16: bool,
    /// What to measure.
    pub profile: ProfileMode,
    /// Where compiled kernels persist; `None` disables the disk cache.
    pub cache_dir: Option<PathBuf>,
    /// One-shot capture destination.
    pub capture: Option<PathBuf>,
    /// Which graph replay the capture records (1-based).
    pub capture_at: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            device: "auto".into(),
            threads: 0,
            serial: false,
            fusion: true,
            schedule: true,
            early_launch: true,
            specialize: true,
            subgroups: true,
            shader_f16: true,
            profile: ProfileMode::Off,
            cache_dir: default_cache_dir(),
            capture: None,
            capture_at: 1,
        }
    }
}

fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("encore"))
}

impl Config {
    /// The defaults with every `ENCORE_*` override from the environment applied.
    pub fn from_env() -> Result<Config> {
        Config::from_vars(|name| std::env::var(name).ok())
    }

    /// Like [`Config::from_env`], reading variables through `get` (for tests).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let mut c = Config::default();
        let get = &get;
        if let Some(v) = get("ENCORE_DEVICE") {
            c.device = v;
        }
        if let Some(v) = get("ENCORE_THREADS") {
            let max = max_threads();
            c.threads =
                usize::try_from(parse_num("ENCORE_THREADS", &v, 0, max as u64)?).unwrap_or(max);
        }
        for (var, field) in [
            ("ENCORE_SERIAL", &mut c.serial),
            ("ENCORE_FUSION", &mut c.fusion),
            ("ENCORE_SCHEDULE", &mut c.schedule),
            ("ENCORE_EARLY_LAUNCH", &mut c.early_launch),
            ("ENCORE_SPECIALIZE", &mut c.specialize),
            ("ENCORE_SUBGROUPS", &mut c.subgroups),
            ("ENCORE_SHADER_F16", &mut c.shader_f16),
        ] {
            if let Some(v) = flag(get, var)? {
                *field = v;
            }
        }
        if let Some(v) = get("ENCORE_PROFILE") {
            c.profile = ProfileMode::parse(&v).ok_or_else(|| Error::Config {
                var: "ENCORE_PROFILE",
                value: v.clone(),
                reason: "expected off, counters, submissions or dispatches".into(),
            })?;
        }
        if let Some(v) = get("ENCORE_CACHE_DIR") {
            c.cache_dir = if v.is_empty() { None } else { Some(v.into()) };
        }
        if let Some(v) = get("ENCORE_CAPTURE") {
            c.capture = if v.is_empty() { None } else { Some(v.into()) };
        }
        if let Some(v) = get("ENCORE_CAPTURE_AT") {
            c.capture_at = parse_num("ENCORE_CAPTURE_AT", &v, 1, u64::MAX)?;
        }
        Ok(c)
    }

    /// The number of CPU worker threads this configuration asks for.
    pub fn cpu_threads(&self) -> usize {
        if self.threads > 0 {
            self.threads
        } else {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        }
    }
}

/// The most CPU worker threads a configuration may ask for: 8 per available
/// core. Oversubscribing the cores further only adds memory (every worker
/// has its stack and scratch) and context switches; a count far beyond it
/// (`ENCORE_THREADS=100000`) would exhaust memory rather than fail cleanly.
pub fn max_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .saturating_mul(8)
}

/// The boolean environment variable `var` read through `get` (`1`, `true`,
/// `yes`, `on` or `0`, `false`, `no`, `off`), `None` when unset: how every
/// `ENCORE_*` switch in the table above is read, in this crate and above it.
pub fn flag(get: impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<bool>> {
    get(var).map(|v| parse_bool(var, &v)).transpose()
}

fn parse_bool(var: &'static str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        _ => Err(Error::Config {
            var,
            value: v.into(),
            reason: "expected 0 or 1".into(),
        }),
    }
}

/// The integer variable `var` of value `v`, which must lie in `min..=max`.
fn parse_num(var: &'static str, v: &str, min: u64, max: u64) -> Result<u64> {
    v.trim()
        .parse()
        .ok()
        .filter(|n| (min..=max).contains(n))
        .ok_or_else(|| Error::Config {
            var,
            value: v.into(),
            reason: format!("expected an integer from {min} to {max}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_overrides_apply() {
        let c = Config::from_vars(|k| match k {
            "ENCORE_SERIAL" => Some("1".into()),
            "ENCORE_THREADS" => Some("3".into()),
            "ENCORE_PROFILE" => Some("dispatches".into()),
            "ENCORE_EARLY_LAUNCH" => Some("0".into()),
            "ENCORE_SPECIALIZE" => Some("off".into()),
            "ENCORE_SUBGROUPS" => Some("0".into()),
            "ENCORE_SHADER_F16" => Some("0".into()),
            _ => None,
        })
        .unwrap();
        assert!(!c.early_launch);
        assert!(Config::default().early_launch);
        assert!(!c.specialize);
        assert!(Config::default().specialize);
        assert!(!c.subgroups);
        assert!(Config::default().subgroups);
        assert!(!c.shader_f16);
        assert!(Config::default().shader_f16);
        assert!(c.serial);
        assert_eq!(c.cpu_threads(), 3);
        assert_eq!(c.profile, ProfileMode::Dispatches);
    }

    #[test]
    fn bad_values_are_typed_errors() {
        let e = Config::from_vars(|k| (k == "ENCORE_SERIAL").then(|| "maybe".into())).unwrap_err();
        assert!(e.to_string().contains("ENCORE_SERIAL"), "{e}");
        assert!(Config::from_vars(|k| (k == "ENCORE_PROFILE").then(|| "x".into())).is_err());
    }

    fn one_var(var: &'static str, value: &str) -> Result<Config> {
        Config::from_vars(|k| (k == var).then(|| value.to_string()))
    }

    #[test]
    fn counts_out_of_range_name_the_variable_and_the_range() {
        let max = max_threads();
        assert_eq!(
            one_var("ENCORE_THREADS", &max.to_string()).unwrap().threads,
            max
        );
        assert_eq!(one_var("ENCORE_THREADS", "0").unwrap().threads, 0);
        let range = format!("from 0 to {max}");
        let too_many = (max + 1).to_string();
        for v in [
            too_many.as_str(),
            "100000",
            "18446744073709551616",
            "-1",
            "2.5",
            "many",
        ] {
            let e = one_var("ENCORE_THREADS", v).unwrap_err().to_string();
            assert!(
                e.contains("ENCORE_THREADS") && e.contains(&range),
                "{v}: {e}"
            );
        }
        let at = one_var("ENCORE_CAPTURE_AT", "18446744073709551615").unwrap();
        assert_eq!(at.capture_at, u64::MAX);
        for v in ["0", "18446744073709551616", "-3", ""] {
            let e = one_var("ENCORE_CAPTURE_AT", v).unwrap_err().to_string();
            assert!(
                e.contains("ENCORE_CAPTURE_AT") && e.contains("from 1 to"),
                "{v}: {e}"
            );
        }
    }
}
