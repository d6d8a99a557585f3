//! What people bring from other finetuning tools: YAML recipes, Parquet
//! data and the alpaca shape, hub ids in the HF cache, TensorBoard event
//! files and a loss plot.

mod common;

use std::path::{Path, PathBuf};

use common::*;

/// The tiny model's run of a few steps with `args`, its metrics written to
/// `dir/NAME.jsonl`: the losses.
fn run(dir: &Path, name: &str, args: &[&str]) -> Vec<f64> {
    let metrics = dir.join(format!("{name}.jsonl"));
    let mut all = vec!["train", "--metrics", metrics.to_str().unwrap()];
    all.extend(args);
    ok(&hlo_train(&all));
    let l = losses(&metrics);
    assert!(!l.is_empty(), "{name}: no losses");
    l
}

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/data")
        .join(name)
}

const FLAGS: [&str; 10] = [
    "--steps",
    "4",
    "--batch",
    "4",
    "--seq",
    "16",
    "--lr",
    "3e-3",
    "--lora-rank",
    "4",
];

#[test]
fn a_recipe_runs_as_its_flags_and_the_saved_recipe_reproduces_the_run() {
    let dir = scratch("ecosystem", "recipe");
    let by_flags = run(&dir, "flags", &FLAGS);
    let recipe = dir.join("r.yaml");
    std::fs::write(
        &recipe,
        "# the same settings as FLAGS\nsteps: 4\nbatch: 4\nseq: 16\nlr: 3.0e-3\nlora-rank: 4\n",
    )
    .unwrap();
    let out = dir.join("out");
    let by_recipe = run(
        &dir,
        "recipe",
        &[
            "--recipe",
            recipe.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(by_recipe, by_flags);
    // A flag wins over its key.
    let mut lr = FLAGS.to_vec();
    lr[7] = "1e-2";
    let by_lr_flag = run(&dir, "lr-flag", &lr);
    let overridden = run(
        &dir,
        "overridden",
        &["--recipe", recipe.to_str().unwrap(), "--lr", "1e-2"],
    );
    assert_eq!(overridden, by_lr_flag);
    assert_ne!(overridden, by_flags);
    // The run's own recipe: every setting, and the same losses again.
    let saved = std::fs::read_to_string(out.join("recipe.yaml")).unwrap();
    for line in [
        "lora_rank: 4",
        "lr: 0.003",
        "mesh: dp=1,fsdp=1,mp=1",
        "dtype: f32",
    ] {
        assert!(saved.lines().any(|l| l == line), "{line}: {saved}");
    }
    let again = run(
        &dir,
        "again",
        &["--recipe", out.join("recipe.yaml").to_str().unwrap()],
    );
    assert_eq!(again, by_flags);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_example_recipes_are_valid_for_their_commands() {
    let recipes = Path::new(env!("CARGO_MANIFEST_DIR")).join("../recipes");
    let mut names: Vec<_> = std::fs::read_dir(&recipes)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    assert!(names.len() >= 5, "{names:?}");
    for r in &names {
        let r = r.to_str().unwrap();
        // Every key is a flag of `train` or `plan` whose value parses: a
        // plan of the tiny preset with the recipe's step reads them all.
        ok(&hlo_train(&[
            "plan", "--recipe", r, "--model", "tiny", "--batch", "8",
        ]));
    }
    // The demo recipe plans as `make demo`'s flags do (the optimizer's
    // numbers included: constants of the program plan compiles).
    let fields = |args: &[&str]| {
        let plan: serde_json::Value = serde_json::from_str(&ok(&hlo_train(args))).unwrap();
        (
            plan["per_device"].clone(),
            plan["mesh"].clone(),
            plan["seq"].clone(),
        )
    };
    let recipe = recipes.join("tiny-demo.yaml");
    assert_eq!(
        fields(&["plan", "--recipe", recipe.to_str().unwrap(), "--json"]),
        fields(&[
            "plan",
            "--batch",
            "16",
            "--seq",
            "16",
            "--lora-rank",
            "16",
            "--lora-alpha",
            "32",
            "--lr",
            "2e-3",
            "--schedule",
            "cosine",
            "--warmup",
            "50",
            "--devices",
            "8",
            "--json"
        ])
    );
}

#[test]
fn parquet_data_and_folders_of_shards_train_as_the_same_jsonl() {
    let dir = scratch("ecosystem", "parquet");
    let with = |name: &str, file: &str| {
        let mut args = FLAGS.to_vec();
        let path = data(file);
        // Rows long enough for alpaca's prompt (bytes of the tiny model).
        args[5] = "256";
        args.extend(["--data", path.to_str().unwrap(), "--packing", "off"]);
        run(&dir, name, &args)
    };
    let jsonl = with("jsonl", "rows.jsonl");
    assert_eq!(with("parquet", "rows.parquet"), jsonl);
    assert_eq!(with("shards", "shards"), jsonl);
    // Alpaca rows are Stanford Alpaca's prompt and completion.
    assert_eq!(
        with("alpaca", "alpaca.parquet"),
        with("alpaca-pc", "alpaca_as_prompt_completion.jsonl")
    );
    // A bad row names its file and row.
    let out = hlo_train(&["train", "--data", data("bad_row.parquet").to_str().unwrap()]);
    let err = one_line_error(&out);
    assert!(err.contains("bad_row.parquet: row 3:"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// `hlo-train ARGS` with the HF cache at `cache`, offline.
fn with_cache(cache: &Path, args: &[&str]) -> std::process::Output {
    hlo_train_env(args, &[("HF_HUB_CACHE", cache)])
}

/// `repo` laid out in an HF cache as `huggingface_hub` lays it out:
/// blobs named by content, a snapshot of relative links to them, and
/// `refs/REF` holding the commit.
fn cache_repo(cache: &Path, repo: &str, commit: &str, refs: &[&str], files: &[(&str, &Path)]) {
    let root = cache.join(format!("models--{}", repo.replace('/', "--")));
    let snapshot = root.join("snapshots").join(commit);
    std::fs::create_dir_all(root.join("blobs")).unwrap();
    for (name, from) in files {
        let target = snapshot.join(name);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        let blob = format!(
            "{:x}",
            name.len() * 7919 + std::fs::metadata(from).unwrap().len() as usize
        );
        std::fs::copy(from, root.join("blobs").join(&blob)).unwrap();
        let up = "../".repeat(name.matches('/').count() + 2);
        std::os::unix::fs::symlink(format!("{up}blobs/{blob}"), &target).unwrap();
    }
    for r in refs {
        let path = root.join("refs").join(r);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, commit).unwrap();
    }
}

#[test]
fn hub_ids_resolve_offline_in_the_hf_cache_and_give_the_folders_logits() {
    let dir = scratch("ecosystem", "hub");
    let cache = dir.join("hub");
    let src = fixture("gqa_llama3");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    cache_repo(
        &cache,
        "test-org/gqa-llama",
        commit,
        &["main", "refs/pr/1"],
        &[
            ("config.json", &src.join("config.json")),
            ("model.safetensors", &src.join("model.safetensors")),
            (
                "generation_config.json",
                &src.join("generation_config.json"),
            ),
        ],
    );
    cache_repo(
        &cache,
        "test-org/gqa-adapter",
        commit,
        &["main"],
        &[
            (
                "adapter_config.json",
                &src.join("adapter/adapter_config.json"),
            ),
            (
                "adapter_model.safetensors",
                &src.join("adapter/adapter_model.safetensors"),
            ),
        ],
    );
    let logits = |checkpoint: &str, adapter: Option<&str>, name: &str| {
        let out = dir.join(format!("{name}.safetensors"));
        let mut args = vec![
            "generate",
            "--checkpoint",
            checkpoint,
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "1",
            "--dump-logits",
            out.to_str().unwrap(),
        ];
        if let Some(a) = adapter {
            args.extend(["--adapter", a]);
        }
        let run = with_cache(&cache, &args);
        assert!(run.status.success(), "{name}: {}", stderr(&run));
        let t = hlo_engine::models::io::read_safetensors(&out).unwrap();
        t[0].1.to_f64s()
    };
    let want = logits(src.to_str().unwrap(), None, "folder");
    for (spec, name) in [
        ("test-org/gqa-llama".to_string(), "main"),
        (format!("test-org/gqa-llama@{commit}"), "commit"),
        ("test-org/gqa-llama@refs/pr/1".to_string(), "pr"),
    ] {
        assert_eq!(logits(&spec, None, name), want, "{spec}");
    }
    let adapter_want = logits(
        src.to_str().unwrap(),
        Some(src.join("adapter").to_str().unwrap()),
        "folder-adapter",
    );
    assert_ne!(adapter_want, want);
    assert_eq!(
        logits(
            "test-org/gqa-llama",
            Some("test-org/gqa-adapter"),
            "hub-adapter"
        ),
        adapter_want
    );
    // Absent: one line naming the folder searched.
    let out = with_cache(
        &cache,
        &[
            "generate",
            "--checkpoint",
            "test-org/absent",
            "--prompt-ids",
            "1",
        ],
    );
    let err = one_line_error(&out);
    let searched = cache.join("models--test-org--absent");
    assert!(
        err.contains(&format!("searched {}", searched.display())) && err.contains("HF_HUB_OFFLINE"),
        "{err}"
    );
    // A revision the cache does not have.
    let out = with_cache(
        &cache,
        &[
            "generate",
            "--checkpoint",
            "test-org/gqa-llama@v2",
            "--prompt-ids",
            "1",
        ],
    );
    let err = one_line_error(&out);
    assert!(err.contains("test-org/gqa-llama@v2"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn tensorboard_events_and_the_loss_plot_are_written() {
    let dir = scratch("ecosystem", "tensorboard");
    let (tb, out, metrics) = (dir.join("tb"), dir.join("out"), dir.join("m.jsonl"));
    let mut args = vec![
        "train",
        "--eval-every",
        "2",
        "--log-every",
        "2",
        "--tensorboard",
        tb.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--metrics",
        metrics.to_str().unwrap(),
    ];
    args.extend(FLAGS);
    ok(&hlo_train(&args));
    // One event file in the run's own folder (named as `--out` is),
    // named as TensorBoard's writers name theirs.
    let events: Vec<_> = std::fs::read_dir(tb.join("out"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    let name = events[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    assert!(std::fs::metadata(&events[0]).unwrap().len() > 200);
    // The run's chart: one train point a step, one eval point an evaluation.
    let svg = std::fs::read_to_string(out.join("loss.svg")).unwrap();
    assert!(
        svg.starts_with("<svg") || svg.starts_with("<?xml"),
        "{}",
        &svg[..60]
    );
    let points = |class: &str| {
        let at = svg.find(&format!("class=\"{class}\"")).unwrap();
        let line = &svg[svg[..at].rfind('<').unwrap()..];
        let line = &line[..line.find("/>").unwrap()];
        let pts = &line[line.find("points=\"").unwrap() + 8..];
        pts[..pts.find('"').unwrap()].split_whitespace().count()
    };
    assert_eq!(points("train"), 4);
    assert_eq!(points("eval"), metric(&metrics, "eval_loss").len());
    // `plot` draws any metrics file; an empty one is one line.
    let drawn = dir.join("drawn.svg");
    ok(&hlo_train(&[
        "plot",
        metrics.to_str().unwrap(),
        "--out",
        drawn.to_str().unwrap(),
    ]));
    assert!(std::fs::read_to_string(&drawn)
        .unwrap()
        .contains("class=\"train\""));
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let err = one_line_error(&hlo_train(&["plot", empty.to_str().unwrap()]));
    assert!(err.contains("holds no loss values"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}
