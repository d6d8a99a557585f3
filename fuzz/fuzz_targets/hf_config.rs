//! Any text as an HF `config.json`: a config or an error, never a panic;
//! an accepted config has consistent heads.
#![no_main]

use hlo_models::decoder::ModelConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    if let Ok(c) = ModelConfig::from_json(text) {
        assert!(c.num_attention_heads > 0 && c.num_key_value_heads > 0);
        assert_eq!(c.num_attention_heads % c.num_key_value_heads, 0);
        let _ = c.parameter_count();
        let _ = c.inv_freq(hlo_models::decoder::LayerType::Full);
    }
});
