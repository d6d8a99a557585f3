//! The mixture-of-experts layer's formulations timed against each other on
//! the CPU plugin (BENCHMARKS.md, "Mixtures of experts"): one sparse layer,
//! forward and the gradient of its output's sum with respect to its input
//! and both fused expert tensors, for Qwen3-30B-A3B's routing (128
//! experts, 8 a token) on smaller matrices, experts run dense (every
//! expert on every token) and as sorted blocks of several sizes; each
//! timed as the best of several runs after one warm-up.
//!
//! cargo run --release -p hlo-e2e --example moe_formulations [TOKENS]

use std::time::Instant;

use hlo_e2e::{client, sparse_layer, RandomLiteral, Rng};
use hlo_ir::value_and_grad;
use hlo_models::decoder::{block_count, block_size, ModelConfig, MoeKind};
use hlo_runtime::{CompiledFunction, HostArray};

fn main() {
    let tokens: i64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(512);
    let mut config = ModelConfig::preset("qwen3-30b-a3b").expect("a preset");
    config.hidden_size = 256;
    config.num_hidden_layers = 1;
    let m = config.moe.as_mut().expect("experts");
    m.moe_intermediate_size = 128;
    m.sparse_layers = vec![true];
    let (e, k) = (m.num_experts, m.top_k);
    let mut rng = Rng::new(1);
    let host: Vec<HostArray> = {
        let layer = sparse_layer(&config, MoeKind::Dense, tokens, true);
        layer
            .input_types()
            .into_iter()
            .map(|t| HostArray::from(rng.literal(t, -0.1, 0.1)))
            .collect()
    };
    let auto = block_size(tokens * k, e);
    println!(
        "one sparse layer, {tokens} tokens, {e} experts ({k} a token), hidden {}, expert width {}: forward + gradient",
        config.hidden_size,
        config.moe.as_ref().map_or(0, |m| m.moe_intermediate_size)
    );
    println!("formulation        rows computed   compile s   best of 5, ms");
    let kinds = [
        ("dense", MoeKind::Dense, tokens * e),
        ("blocks of 8", MoeKind::Blocks { block: Some(8) }, 0),
        (
            "blocks (auto)",
            MoeKind::Blocks { block: None },
            block_count(tokens * k, e, auto) * auto,
        ),
        ("blocks of 64", MoeKind::Blocks { block: Some(64) }, 0),
    ];
    for (label, kind, rows) in kinds {
        let rows = match kind {
            MoeKind::Blocks { block: Some(b) } => block_count(tokens * k, e, b) * b,
            _ => rows,
        };
        let layer = sparse_layer(&config, kind, tokens, true);
        let wrt = [
            "x",
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj",
        ];
        let step = value_and_grad(&layer, "sum", &wrt).expect("differentiated");
        let start = Instant::now();
        let compiled = CompiledFunction::new(client(), &step).expect("compiled");
        let compile = start.elapsed().as_secs_f64();
        compiled.run(&host).expect("ran");
        let best = (0..5)
            .map(|_| {
                let t = Instant::now();
                compiled.run(&host).expect("ran");
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        println!(
            "{label:<18} {rows:>13}   {compile:>9.2}   {:>13.1}",
            best * 1e3
        );
    }
}
