//! The command line as users script against it (docs/cli.md), run
//! as a process on the real CPU plugin.

mod common;

use common::*;

use std::process::Command;

#[test]
fn devices_json_lists_eight_cpu_devices() {
    let out = hlo_train(&["devices", "--devices", "8", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["platform"], "cpu");
    assert!(v["plugin"]
        .as_str()
        .unwrap()
        .ends_with("pjrt_cpu_plugin.so"));
    let (major, minor) = v["api_version"]
        .as_str()
        .unwrap()
        .split_once('.')
        .expect("MAJOR.MINOR");
    let version = (major.parse::<i32>().unwrap(), minor.parse::<i32>().unwrap());
    assert!(version >= hlo_engine::runtime::MIN_API_VERSION);
    assert!(v["platform_version"].is_string());
    let devices = v["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 8);
    for (i, d) in devices.iter().enumerate() {
        assert_eq!(d["id"], i);
        assert_eq!(d["kind"], "cpu");
        assert_eq!(d["process_index"], 0);
    }
    // Nothing but the JSON on stdout, and XLA's logs kept quiet.
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
}

#[test]
fn devices_text_names_plugin_platform_and_api() {
    let out = hlo_train(&["devices", "--devices", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "plugin ",
        "platform ",
        "platform version ",
        "PJRT API ",
        "devices ",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
    assert_eq!(text.matches("CpuDevice(id=").count(), 2, "{text}");
}

#[test]
fn missing_plugin_path_is_one_clear_line() {
    let err = one_line_error(&hlo_train(&[
        "devices",
        "--plugin",
        "/nonexistent/pjrt_plugin.so",
    ]));
    assert_eq!(
        err,
        "error: PJRT plugin not found at /nonexistent/pjrt_plugin.so"
    );
}

#[test]
fn plugin_from_the_environment() {
    let out = Command::new(env!("CARGO_BIN_EXE_hlo-train"))
        .args(["devices"])
        .env("HLO_TRAIN_PLUGIN", "/nonexistent/from_env.so")
        .output()
        .unwrap();
    let err = one_line_error(&out);
    assert!(err.contains("/nonexistent/from_env.so"), "{err}");
}

#[test]
fn a_file_that_is_not_a_plugin_is_one_clear_line() {
    let dir = scratch("cli", "notaplugin");
    let file = dir.join("libnot_a_plugin.so");
    std::fs::write(&file, "#!/bin/sh\necho hello\n").unwrap();
    let err = one_line_error(&hlo_train(&["devices", "--plugin", file.to_str().unwrap()]));
    assert!(
        err.starts_with(&format!(
            "error: cannot load {} as a PJRT plugin: ",
            file.display()
        )),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn cuda_without_a_jax_plugin_says_what_to_install() {
    // A python3 whose only site folder holds no jax_plugins.
    let dir = scratch("cli", "nocuda");
    let python = dir.join("python3");
    std::fs::write(&python, format!("#!/bin/sh\necho {}\n", dir.display())).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let out = Command::new(env!("CARGO_BIN_EXE_hlo-train"))
        .args(["devices", "--plugin", "cuda"])
        .env("HLO_TRAIN_PYTHON", &python)
        .output()
        .unwrap();
    let err = one_line_error(&out);
    assert!(err.contains("no CUDA PJRT plugin found"), "{err}");
    assert!(err.contains("pip install"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn flag_values_out_of_range_are_refused() {
    let out = hlo_train(&["devices", "--devices", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--devices"), "{}", stderr(&out));
    assert!(!stderr(&out).contains("panicked"));
}

#[test]
fn dump_hlo_writes_both_formats_and_the_stablehlo_compiles() {
    let dir = scratch("cli", "dump");
    let out = hlo_train(&[
        "dump-hlo",
        "--what",
        "forward",
        "--format",
        "both",
        "--out",
        dir.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "8",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mlir = std::fs::read_to_string(dir.join("forward.stablehlo.mlir")).unwrap();
    let hlo = std::fs::read_to_string(dir.join("forward.hlo.txt")).unwrap();
    assert!(mlir.contains("{jax.arg_info = \"model.embed_tokens.weight\"}"));
    assert!(mlir.contains("loc(\"model.layers.1.self_attn.q_proj\")"));
    assert!(hlo.starts_with("HloModule jit_llama_forward"));
    assert!(hlo.contains("metadata={op_name=\"model.layers.0.mlp.down_proj\"}"));
    // No temporary files are left behind.
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    // The dumped StableHLO is a program the plugin compiles.
    let plugin =
        hlo_engine::runtime::Plugin::load(hlo_engine::runtime::PluginSpec::Cpu.resolve().unwrap())
            .unwrap();
    let client =
        hlo_engine::runtime::Client::new(&plugin, &hlo_engine::runtime::ClientOptions::cpu(1))
            .unwrap();
    let exe = client
        .compile(&mlir, &hlo_engine::runtime::CompileOptions::default())
        .unwrap();
    assert_eq!(exe.num_outputs(), 1);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn dump_hlo_train_step_to_stdout_and_bad_out_dir() {
    let out = hlo_train(&["dump-hlo", "--format", "hlo", "--batch", "2", "--seq", "8"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The default is the train step: forward, backward and update.
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.starts_with("HloModule jit_train_step"),
        "{}",
        &text[..80]
    );
    assert!(text.contains("op_name=\"backward.model.layers.0.mlp.down_proj\""));
    assert!(text.contains("op_name=\"optimizer\""));
    let dir = scratch("cli", "file");
    let file = dir.join("a_file");
    std::fs::write(&file, "x").unwrap();
    let err = one_line_error(&hlo_train(&["dump-hlo", "--out", file.to_str().unwrap()]));
    assert!(err.contains("cannot create"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn dump_hlo_of_big_presets_with_a_mesh_and_xla_dumps() {
    // 405B from abstract shapes: layers scanned, shardings from the rules.
    let out = hlo_train(&[
        "dump-hlo",
        "--model",
        "llama3.1-405b",
        "--dtype",
        "bf16",
        "--format",
        "stablehlo",
        "--mesh",
        "dp=1,fsdp=8,mp=1",
        "--batch",
        "16",
        "--seq",
        "64",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("sdy.mesh @mesh = <[\"dp\"=1, \"fsdp\"=8, \"mp\"=1]>"));
    assert!(text.contains("tensor<126x16384x16384xbf16> {jax.arg_info = \"model.layers.self_attn.q_proj.weight\", sdy.sharding = #sdy.sharding<@mesh, [{}, {\"mp\"}, {\"fsdp\"}]>}"), "the layer axis stays whole");
    assert!(text.contains("\"stablehlo.while\""));
    // XLA's own after-optimization HLO, for the tiny model on 2 devices.
    let dir = scratch("cli", "xla");
    let out = hlo_train(&[
        "dump-hlo",
        "--what",
        "forward",
        "--format",
        "hlo",
        "--batch",
        "2",
        "--seq",
        "8",
        "--mesh",
        "dp=1,fsdp=2,mp=1",
        "--xla-dump",
        dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().any(|n| n.contains("after_optimizations")),
        "{names:?}"
    );
    std::fs::remove_dir_all(dir).unwrap();
    // A mesh that does not divide a tensor, and one that does not parse.
    let err = one_line_error(&hlo_train(&["dump-hlo", "--mesh", "dp=1,fsdp=3,mp=1"]));
    assert!(err.contains("does not divide over fsdp (3 parts)"), "{err}");
    let out = hlo_train(&["dump-hlo", "--mesh", "dp=x"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("bad mesh `dp=x`"), "{}", stderr(&out));
}

#[test]
fn plan_reports_per_device_memory_as_json() {
    let out = hlo_train(&[
        "plan",
        "--batch",
        "8",
        "--seq",
        "16",
        "--mesh",
        "dp=2,fsdp=2,mp=2",
        "--target",
        "h100",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let d = &v["per_device"];
    for k in [
        "weights_bytes",
        "lora_bytes",
        "optimizer_bytes",
        "total_bytes",
    ] {
        assert!(d[k].as_u64().is_some(), "{k}");
    }
    for k in ["argument_bytes", "output_bytes", "temp_bytes"] {
        assert!(d["xla"][k].as_u64().unwrap() > 0, "{k}");
    }
    assert_eq!(v["device_memory_bytes"], 80_000_000_000u64);
    assert_eq!(v["fits"], true);
    // Weights: tiny has 107,840 parameters; bf16 on 8 devices, each holding
    // an eighth of everything but the replicated norms.
    let w = d["weights_bytes"].as_u64().unwrap();
    assert!(w > 107_840 * 2 / 8 && w < 107_840 * 2 / 2, "{w}");
    // Optimizer state: two f32 moments per LoRA weight.
    assert_eq!(
        d["optimizer_bytes"].as_u64().unwrap(),
        2 * d["lora_bytes"].as_u64().unwrap()
    );
    let text = String::from_utf8_lossy(
        &hlo_train(&["plan", "--batch", "8", "--seq", "16", "--show-sharding"]).stdout,
    )
    .into_owned();
    assert!(
        text.contains("fits") && text.contains("P('mp', 'fsdp')"),
        "{text}"
    );
}

/// `--devices` is accepted by every command that runs on devices, and a
/// mesh that disagrees with it is one line naming both.
#[test]
fn devices_and_mesh_agree_or_are_refused() {
    let out = hlo_train(&[
        "plan",
        "--devices",
        "2",
        "--mesh",
        "dp=1,fsdp=2,mp=1",
        "--batch",
        "4",
        "--seq",
        "8",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    assert_eq!(v["mesh"], "dp=1,fsdp=2,mp=1");
    // --devices alone makes the mesh dp=1,fsdp=N,mp=1.
    let v: serde_json::Value = serde_json::from_str(&ok(&hlo_train(&[
        "plan",
        "--devices",
        "2",
        "--batch",
        "4",
        "--seq",
        "8",
        "--json",
    ])))
    .unwrap();
    assert_eq!(v["mesh"], "dp=1,fsdp=2,mp=1");
    for command in ["train", "bench", "generate", "plan", "dump-hlo"] {
        let mut args = vec![command, "--mesh", "dp=1,fsdp=2,mp=1", "--devices", "4"];
        if command == "generate" {
            args.extend(["--prompt", "a"]);
        }
        let err = one_line_error(&hlo_train(&args));
        assert!(
            err.contains("the mesh dp=1,fsdp=2,mp=1 spans 2 devices but 4 were asked for"),
            "{command}: {err}"
        );
    }
    // The train header says which devices run.
    let out = ok(&hlo_train(&[
        "train",
        "--devices",
        "2",
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq",
        "8",
    ]));
    assert!(
        out.contains("on dp=1,fsdp=2,mp=1 (2 virtual CPU devices)"),
        "{out}"
    );
}

/// An axis the mesh leaves out has size 1: `--mesh dp=2,fsdp=2` trains as
/// dp=2,fsdp=2,mp=1 (and is recorded so), `fsdp=2` plans as
/// dp=1,fsdp=2,mp=1; an axis no rule splits over is still refused.
#[test]
fn a_mesh_that_leaves_an_axis_out_has_it_of_size_one() {
    let dir = scratch("cli", "mesh-axes");
    let out = dir.join("run");
    let text = ok(&hlo_train(&[
        "train",
        "--devices",
        "4",
        "--mesh",
        "dp=2,fsdp=2",
        "--steps",
        "1",
        "--batch",
        "4",
        "--seq",
        "8",
        "--out",
        out.to_str().unwrap(),
    ]));
    assert!(
        text.contains("on dp=2,fsdp=2,mp=1 (4 virtual CPU devices)"),
        "{text}"
    );
    let recipe = std::fs::read_to_string(out.join("recipe.yaml")).unwrap();
    assert!(recipe.contains("dp=2,fsdp=2,mp=1"), "{recipe}");
    let v: serde_json::Value = serde_json::from_str(&ok(&hlo_train(&[
        "plan", "--mesh", "fsdp=2", "--batch", "4", "--seq", "8", "--json",
    ])))
    .unwrap();
    assert_eq!(v["mesh"], "dp=1,fsdp=2,mp=1");
    let err = one_line_error(&hlo_train(&[
        "train",
        "--mesh",
        "dp=2,xx=2",
        "--steps",
        "1",
    ]));
    assert!(err.contains("has an axis `xx`"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// On a terminal, the seconds before a run's header say what they are
/// (reading, tracing, compiling); piped, nothing extra is printed.
#[test]
fn a_run_says_what_it_does_before_its_header_on_a_terminal() {
    let bin = env!("CARGO_BIN_EXE_hlo-train");
    let line = format!("{bin} train --steps 1 --batch 2 --seq 8");
    // `script` gives the command a terminal.
    let out = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .env_remove("HLO_TRAIN_PLUGIN")
        .output()
        .expect("run script");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("tracing and compiling the step"), "{text}");
    let piped = ok(&hlo_train(&[
        "train", "--steps", "1", "--batch", "2", "--seq", "8",
    ]));
    assert!(!piped.contains("compiling the step"), "{piped}");
}
