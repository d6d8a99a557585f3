//! TRL's, transformers' and PEFT's names for settings, given as flags or
//! recipe keys, are answered with hlo-train's flag that means the same:
//! one line, exit code 2, nothing run.

mod common;

use common::*;

/// `hlo-train ARGS`'s one-line error.
fn error_of(args: &[&str]) -> String {
    one_line_error(&hlo_train(args))
}

#[test]
fn trl_and_transformers_flags_name_ours() {
    for (flag, value, want) in [
        (
            "--learning-rate",
            "1e-4",
            "error: unexpected argument '--learning-rate': hlo-train's flag for TRL's learning_rate is --lr",
        ),
        (
            "--max-steps",
            "10",
            "hlo-train's flag for transformers' max_steps is --steps",
        ),
        (
            "--per-device-train-batch-size",
            "4",
            "hlo-train's flag for transformers' per_device_train_batch_size is --batch (",
        ),
        ("--lora-r", "16", "hlo-train's flag for TRL's lora_r is --lora-rank"),
        (
            "--output-dir",
            "out",
            "hlo-train's flag for transformers' output_dir is --out",
        ),
        (
            "--model-name-or-path",
            "Qwen/Qwen3-0.6B",
            "hlo-train's flag for TRL's model_name_or_path is --checkpoint",
        ),
        (
            "--gradient-accumulation-steps",
            "2",
            "hlo-train's flag for transformers' gradient_accumulation_steps is --grad-accum",
        ),
        ("--max-length", "512", "hlo-train's flag for TRL's max_length is --seq"),
        // argparse's spelling, and `--flag=value`.
        (
            "--learning_rate=2e-5",
            "",
            "unexpected argument '--learning_rate': hlo-train's flag for TRL's learning_rate is --lr",
        ),
        (
            "--warmup-ratio",
            "0.1",
            "hlo-train's flag for transformers' warmup_ratio is --warmup (whole steps: the ratio times --steps)",
        ),
    ] {
        let mut args = vec!["train", flag];
        if !value.is_empty() {
            args.push(value);
        }
        let err = error_of(&args);
        assert!(err.contains(want), "{flag}: {err}");
        assert!(!err.contains("see --help"), "{flag}: {err}");
    }
    // The same names for the other commands that have the flag.
    let err = error_of(&["plan", "--per-device-train-batch-size", "1"]);
    assert!(err.contains("is --batch"), "{err}");
    // One of ours spelled as argparse allows.
    let err = error_of(&["train", "--lora_alpha", "32"]);
    assert!(
        err.ends_with("hlo-train's flags are spelled with dashes: --lora-alpha"),
        "{err}"
    );
    // A command without the flag keeps clap's message.
    let err = error_of(&["generate", "--learning-rate", "1e-4"]);
    assert!(!err.contains("--lr"), "{err}");
}

#[test]
fn epochs_are_answered_with_steps() {
    let err = error_of(&["train", "--num-train-epochs", "3"]);
    assert!(
        err.starts_with(
            "error: unexpected argument '--num-train-epochs': transformers' num_train_epochs has no hlo-train flag: a run counts optimizer steps, not epochs"
        ),
        "{err}"
    );
    assert!(
        err.contains("--steps E × ceil(N / (B × K))") && err.contains("hlo-train data"),
        "{err}"
    );
}

#[test]
fn kto_loss_types_point_to_kto_loss_type() {
    let err = error_of(&[
        "train",
        "--objective",
        "kto",
        "--loss-type",
        "apo_zero_unpaired",
    ]);
    assert_eq!(
        err,
        "error: invalid value 'apo_zero_unpaired' for '--loss-type' (GRPO's loss): KTO's loss_type (TRL's KTOConfig) is --kto-loss-type apo_zero_unpaired"
    );
    let err = error_of(&["train", "--objective", "dpo", "--loss-type", "ipo"]);
    assert!(
        err.ends_with("TRL's DPOConfig loss_type ipo is --objective ipo here"),
        "{err}"
    );
}

#[test]
fn trl_recipe_keys_name_ours() {
    let dir = scratch("hints", "recipe");
    for (text, want) in [
        (
            "learning_rate: 2.0e-5\n",
            "unknown key `learning_rate`: hlo-train's key for TRL's learning_rate is `lr`",
        ),
        (
            "max_length: 512\n",
            "unknown key `max_length`: hlo-train's key for TRL's max_length is `seq`",
        ),
        (
            "gradient_accumulation_steps: 4\n",
            "unknown key `gradient_accumulation_steps`: hlo-train's key for transformers' gradient_accumulation_steps is `grad_accum`",
        ),
        (
            "num_train_epochs: 3\n",
            "unknown key `num_train_epochs`: transformers' num_train_epochs has no hlo-train key",
        ),
        (
            "bf16: true\n",
            "unknown key `bf16`: hlo-train's key for TRL's bf16 is `dtype: bf16`",
        ),
    ] {
        let recipe = dir.join("trl.yaml");
        std::fs::write(&recipe, text).unwrap();
        for command in ["train", "plan"] {
            let err = error_of(&[command, "--recipe", recipe.to_str().unwrap()]);
            assert!(err.contains(want), "{command} {text:?}: {err}");
            assert!(err.contains("trl.yaml"), "{err}");
        }
    }
    // A recipe's KTO loss_type reaches the flag's hint.
    let recipe = dir.join("kto.yaml");
    std::fs::write(&recipe, "objective: kto\nloss_type: apo_zero_unpaired\n").unwrap();
    let err = error_of(&["train", "--recipe", recipe.to_str().unwrap()]);
    assert!(
        err.contains("is --kto-loss-type apo_zero_unpaired"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
