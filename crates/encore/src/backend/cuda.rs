//! The CUDA backend (placeholder until the NVRTC backend lands).

use super::Backend;
use crate::config::Config;
use crate::device::DeviceInfo;
use crate::error::{Error, Result};

pub(crate) fn device_count() -> usize {
    0
}

pub(crate) fn list() -> Vec<DeviceInfo> {
    Vec::new()
}

pub(crate) struct CudaBackend;

impl CudaBackend {
    pub(crate) fn open(ordinal: usize, _config: &Config) -> Result<std::sync::Arc<dyn Backend>> {
        Err(Error::DeviceUnavailable {
            name: format!("cuda:{ordinal}"),
            reason: "no CUDA backend yet".into(),
        })
    }
}
