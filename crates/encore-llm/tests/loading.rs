//! Loading a model file as a user does: the fit check passes a small model
//! on the CPU (whose free memory Linux reports), progress reaches every
//! byte, and the engine it gives generates.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use encore::Device;
use encore_llm::synthetic::{synthetic_gguf, SyntheticSpec};
use encore_llm::{Engine, EngineOptions, GenerateOptions, LoadProgress};

#[test]
fn a_synthetic_model_file_loads_with_progress_and_generates() {
    let path = std::env::temp_dir().join(format!("encore-loading-{}.gguf", std::process::id()));
    std::fs::write(&path, synthetic_gguf(&SyntheticSpec::tiny(11))).unwrap();
    let device = Device::cpu().unwrap();
    let mut seen: Vec<LoadProgress> = Vec::new();
    let engine =
        Engine::load_with_progress(&path, &device, &EngineOptions::default(), |p| seen.push(p));
    std::fs::remove_file(&path).unwrap();
    let engine = engine.unwrap();
    let last = *seen.last().unwrap();
    assert!(seen.len() > 2 && seen[0].bytes_done == 0, "{seen:?}");
    assert_eq!(last.bytes_done, last.bytes_total);
    // Every copied byte is a weight, a norm or a bias on the device.
    assert!(last.bytes_total >= engine.model().weight_bytes() as u64);
    assert!(last.bytes_total <= device.pool_stats().live_bytes);
    let generation = engine
        .generate("hi", &GenerateOptions::greedy(4), |_| true)
        .unwrap();
    assert!(!generation.tokens.is_empty());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn on_cuda_a_model_that_does_not_fit_is_refused_before_anything_is_allocated() {
    use encore_llm::gguf::GgufFile;
    use encore_llm::load::LOAD_MARGIN_BYTES;
    use encore_llm::{LlmError, Model};
    use encore_ops::KernelSet;

    let device = Device::open("cuda", &encore::Config::default()).unwrap();
    let file = GgufFile::from_bytes(synthetic_gguf(&SyntheticSpec::smollm2_135m(5))).unwrap();
    let free = || {
        device
            .memory()
            .unwrap()
            .expect("CUDA reports its memory")
            .free
    };
    let memory = device.memory().unwrap().unwrap();
    eprintln!("{}: {memory:?}", device.name());
    assert!(0 < memory.free && memory.free <= memory.total);
    // Ballast until less than the margin and 16 MiB are free: the model's
    // weights (about 100 MB) then cannot fit.
    let mut ballast = Vec::new();
    for chunk in [1u64 << 30, 16 << 20] {
        while free() >= LOAD_MARGIN_BYTES + chunk {
            ballast.push(device.alloc(chunk as usize).unwrap());
        }
    }
    let live = device.pool_stats().live_bytes;
    let refused = Model::load(&file, &device, KernelSet::Default).err();
    let Some(e @ LlmError::WeightsDoNotFit { .. }) = refused else {
        panic!("want WeightsDoNotFit, got {refused:?}");
    };
    eprintln!("{e}");
    assert_eq!(device.pool_stats().live_bytes, live, "nothing allocated");
    // The ballast, dropped, waits in the pool, which gives it back when an
    // allocation needs it: it counts as free, and the model loads.
    drop(ballast);
    assert!(device.pool_stats().pooled_bytes > 0);
    let mut last = None;
    let model =
        Model::load_with_progress(&file, &device, KernelSet::Default, |p| last = Some(p)).unwrap();
    let last = last.unwrap();
    assert_eq!(last.bytes_done, last.bytes_total);
    assert!(last.bytes_total >= model.weight_bytes() as u64);
}
