//! A step whose cuDNN attention fails to compile (here on the CPU, which
//! has no cuDNN) is compiled again with its fallback, XLA's attention,
//! when one is given, and the session says why; without one the error is
//! the compile's.

use hlo_engine::device::backend::{Backend, BackendOptions};
use hlo_engine::inputs::model::{Model, ModelSource};
use hlo_engine::models::attention::AttentionKind;
use hlo_engine::models::decoder::{LoraConfig, DEFAULT_TARGETS};
use hlo_engine::models::train::TrainConfig;
use hlo_engine::train::session::{Session, SessionOptions};

fn step(attention: AttentionKind) -> TrainConfig {
    let lora = LoraConfig::new(4, 8.0, &DEFAULT_TARGETS, false).unwrap();
    let mut c = TrainConfig::new(hlo_engine::ir::DType::BF16, 2, 16).with_lora(Some(lora));
    c.attention = attention;
    c
}

fn session(fallback: Option<TrainConfig>) -> hlo_engine::Result<Session> {
    std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "3");
    let model = Model::open(&ModelSource::Preset("tiny".into())).unwrap();
    let backend = Backend::open(&BackendOptions::cpu()).unwrap();
    let options = SessionOptions {
        fallback,
        ..SessionOptions::default()
    };
    Session::new(backend, model, step(AttentionKind::Cudnn), options)
}

#[test]
fn a_cudnn_step_that_fails_to_compile_falls_back_to_xla_attention() {
    let e = session(None)
        .err()
        .expect("cuDNN's call does not compile on the CPU");
    let alone = e.to_string();
    let s = session(Some(step(AttentionKind::Naive))).unwrap();
    assert_eq!(s.config().attention, AttentionKind::Naive);
    let why = s.fell_back().expect("the session says it fell back");
    assert_eq!(why, alone);
    // The fallback step was compiled.
    assert!(s.compile_s() > 0.0);
}
