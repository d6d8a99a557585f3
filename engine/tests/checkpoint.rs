//! A checkpoint never holds non-finite values: `save` refuses (writing
//! nothing) when a trained tensor is not finite, as after an update that
//! overflowed while the loss before it was still finite.

use hlo_engine::device::backend::{Backend, BackendOptions};
use hlo_engine::inputs::model::{Model, ModelSource};
use hlo_engine::ir::Literal;
use hlo_engine::models::decoder::{LoraConfig, DEFAULT_TARGETS};
use hlo_engine::models::train::TrainConfig;
use hlo_engine::train::checkpoint::{self, RunSettings, RunState};
use hlo_engine::train::session::{Session, SessionOptions};
use hlo_engine::EngineError;

#[test]
fn a_non_finite_parameter_is_never_saved() {
    std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "3");
    let model = Model::open(&ModelSource::Preset("tiny".into())).unwrap();
    let backend = Backend::open(&BackendOptions::cpu()).unwrap();
    let lora = LoraConfig::new(4, 8.0, &DEFAULT_TARGETS, false).unwrap();
    let config = TrainConfig::new(hlo_engine::ir::DType::F32, 2, 8).with_lora(Some(lora));
    let mut session = Session::new(backend, model, config, SessionOptions::default()).unwrap();
    // The state with one parameter overflowed.
    let mut tensors = session.checkpoint_tensors().unwrap();
    let (name, lit) = tensors
        .iter_mut()
        .find(|(n, _)| n.ends_with("lora_a"))
        .unwrap();
    let name = name.clone();
    let mut values = lit.to_f64s();
    values[3] = f64::INFINITY;
    *lit = Literal::from_f64s(lit.ty.clone(), &values);
    session.restore(&tensors).unwrap();
    let out = std::env::temp_dir().join(format!("hlo-engine-nan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let state = RunState {
        version: 2,
        step: 1,
        data_cursor: 0,
        settings: RunSettings::of(&session),
        checksum: None,
    };
    let err = checkpoint::save(&out, &session, &state).unwrap_err();
    match &err {
        EngineError::NonFiniteState { tensor, bad, .. } => {
            assert_eq!((tensor.as_str(), *bad), (name.as_str(), 1))
        }
        other => panic!("{other}"),
    }
    assert!(!out.join("adapter_model.safetensors").exists());
    assert!(!out.join("train_state").exists());
    // Checked before anything is written: not even the folder is made.
    assert!(!out.exists(), "{} was created", out.display());
}
