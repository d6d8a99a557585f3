//! Meshes, specs and rules: parsing, validation errors (one per kind, each
//! naming the tensor and dimension), block placement and the ASCII view.

use hlo_ir::{trace, DType, TensorType};
use hlo_partitioner::{
    draw_sharding, FunctionShardings, Mesh, PartitionSpec, Rules, ShardingError,
};

fn mesh(s: &str) -> Mesh {
    s.parse().unwrap()
}

fn p(dims: &[&[&str]]) -> PartitionSpec {
    PartitionSpec::new(dims)
}

#[test]
fn mesh_parse_errors() {
    for (text, reason) in [
        ("dp=2,fsdp", "`fsdp` is not NAME=SIZE"),
        ("dp=two", "`two` is not a size"),
        ("dp=0,mp=2", "axis `dp` has size 0"),
        ("dp=2,dp=2", "axis `dp` appears twice"),
        ("d p=2", "axis name `d p` is not a word"),
    ] {
        let err = text.parse::<Mesh>().unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("bad mesh `{text}`: {reason} (expected e.g. dp=1,fsdp=8,mp=1)")
        );
    }
}

#[test]
fn mesh_must_match_the_device_count() {
    let err = mesh("dp=2,fsdp=8,mp=1").check_devices(8).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the mesh dp=2,fsdp=8,mp=1 has 16 devices but there are 8"
    );
    assert!(mesh("dp=1,fsdp=8,mp=1").check_devices(8).is_ok());
}

#[test]
fn each_spec_error_names_tensor_and_dimension() {
    let m = mesh("dp=2,fsdp=4,mp=1");
    let err = p(&[&["fsdp"], &["tp"]])
        .validate(&m, &[8, 8], "layers.0.mlp.up_proj.weight")
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "`layers.0.mlp.up_proj.weight`: dimension 1 uses axis `tp`, which the mesh dp=2,fsdp=4,mp=1 does not have"
    );
    let err = p(&[&["fsdp"], &["dp", "fsdp"]])
        .validate(&m, &[8, 8], "w")
        .unwrap_err();
    assert_eq!(
        err,
        ShardingError::AxisTwice {
            tensor: "w".into(),
            axis: "fsdp".into(),
            first: 0,
            second: 1
        }
    );
    let err = p(&[&[], &["dp", "fsdp"]])
        .validate(&m, &[8, 12], "x")
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "`x`: dimension 1 of size 12 does not divide over dp×fsdp (8 parts)"
    );
    let err = p(&[&[], &[], &["mp"]])
        .validate(&m, &[8, 12], "x")
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "`x`: the spec P(None, None, 'mp') has 3 entries for a rank-2 tensor"
    );
}

#[test]
fn spec_parsing() {
    assert_eq!(
        PartitionSpec::parse("P('fsdp', 'mp')").unwrap(),
        p(&[&["fsdp"], &["mp"]])
    );
    assert_eq!(
        PartitionSpec::parse("(('dp', \"fsdp\"), None)").unwrap(),
        p(&[&["dp", "fsdp"], &[]])
    );
    assert_eq!(
        PartitionSpec::parse("fsdp,mp").unwrap(),
        p(&[&["fsdp"], &["mp"]])
    );
    assert_eq!(
        PartitionSpec::parse("P()").unwrap(),
        PartitionSpec::replicated()
    );
    assert!(PartitionSpec::parse("P(('dp', 'fsdp')").is_err());
    assert!(PartitionSpec::parse("P(1+2)").is_err());
    let spec = p(&[&["dp", "fsdp"], &[], &["mp"]]);
    assert_eq!(PartitionSpec::parse(&spec.to_string()).unwrap(), spec);
}

#[test]
fn blocks_follow_the_row_major_mesh() {
    let m = mesh("dp=2,fsdp=2,mp=2");
    let spec = p(&[&["dp", "fsdp"], &["mp"]]);
    assert_eq!(spec.shard_shape(&m, &[8, 12]), vec![2, 6]);
    // device 5 = (dp 1, fsdp 0, mp 1): row block 1*2+0 = 2, column block 1.
    assert_eq!(spec.shard_offset(&m, &[8, 12], 5), vec![4, 6]);
    // Reversed axis order changes which block a device holds.
    let rev = p(&[&["fsdp", "dp"], &["mp"]]);
    assert_eq!(rev.shard_offset(&m, &[8, 12], 5), vec![2, 6]);
    assert!(p(&[&["mp"]]).is_replicated(&mesh("dp=4,fsdp=2,mp=1")));
}

#[test]
fn rules_first_match_wins_and_scalars_are_replicated() {
    let rules = Rules::new(&[
        (r"lora_a$", p(&[&["fsdp"], &["mp"]])),
        (r"proj", p(&[&["mp"], &["fsdp"]])),
    ])
    .unwrap();
    assert_eq!(
        rules.spec_for("layers.0.self_attn.q_proj.lora_a", 2),
        p(&[&["fsdp"], &["mp"]])
    );
    assert_eq!(
        rules.spec_for("layers.0.self_attn.q_proj.weight", 2),
        p(&[&["mp"], &["fsdp"]])
    );
    assert_eq!(
        rules.spec_for("layers.0.self_attn.q_proj.scale", 0),
        PartitionSpec::replicated()
    );
    assert_eq!(
        rules.spec_for("norm.weight", 1),
        PartitionSpec::replicated()
    );
    assert!(matches!(
        Rules::new(&[("(", PartitionSpec::replicated())]),
        Err(ShardingError::BadRule { index: 0, .. })
    ));
}

#[test]
fn rules_from_json() {
    let rules = Rules::from_json(r#"[["embed", ["mp", "fsdp"]], ["^input_ids$", [["dp", "fsdp"], null]], ["norm", null], ["head", "P('fsdp', 'mp')"]]"#).unwrap();
    assert_eq!(
        rules.spec_for("model.embed_tokens.weight", 2),
        p(&[&["mp"], &["fsdp"]])
    );
    assert_eq!(rules.spec_for("input_ids", 2), p(&[&["dp", "fsdp"], &[]]));
    assert_eq!(
        rules.spec_for("lm_head.weight", 2),
        p(&[&["fsdp"], &["mp"]])
    );
    for bad in ["{}", "[[1, 2]]", "[[\"x\"]]", "[[\"x\", 3]]", "not json"] {
        assert!(Rules::from_json(bad).is_err(), "{bad}");
    }
}

#[test]
fn function_shardings_validate_every_tensor() {
    let t = |d: &[i64]| TensorType::new(DType::F32, d.to_vec());
    let f = trace("f", &[("x", t(&[6, 4])), ("weight", t(&[4, 4]))], |i| {
        vec![("y", i["x"].matmul(i["weight"]))]
    })
    .unwrap();
    let rules = Rules::new(&[("^x$", p(&[&["fsdp"]]))]).unwrap();
    let err = FunctionShardings::from_rules(&f, &mesh("dp=1,fsdp=4,mp=1"), &rules).unwrap_err();
    assert_eq!(
        err.to_string(),
        "`x`: dimension 0 of size 6 does not divide over fsdp (4 parts)"
    );
    let ok = FunctionShardings::from_rules(&f, &mesh("dp=1,fsdp=2,mp=1"), &rules).unwrap();
    assert_eq!(
        ok.inputs,
        vec![p(&[&["fsdp"]]), PartitionSpec::replicated()]
    );
    assert!(ok.report(&f).contains("in  x"));
}

#[test]
fn ascii_view_shows_who_holds_each_block() {
    let m = mesh("dp=2,fsdp=2,mp=2");
    let text = draw_sharding(&m, &p(&[&["fsdp"], &["mp"]]), &[8, 8]);
    let want = "\
[8, 8] P('fsdp', 'mp') over dp=2,fsdp=2,mp=2
+-----+-----+
| 0,4 | 1,5 |
+-----+-----+
| 2,6 | 3,7 |
+-----+-----+
";
    assert_eq!(text, want);
    let row = draw_sharding(&m, &p(&[&["dp", "fsdp", "mp"]]), &[16]);
    assert!(
        row.contains("| 0   | 1   | 2   | 3   | 4   | 5   | 6   | 7   |"),
        "{row}"
    );
}
