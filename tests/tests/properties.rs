//! Property tests (proptest): shape inference, broadcasting and partition
//! spec validation against rules restated here, on random shapes, meshes
//! and specs.

use hlo_e2e::{RandomLiteral, Rng};
use hlo_ir::{interpret, trace, DType, TensorType};
use hlo_partitioner::{Mesh, PartitionSpec, ShardingError};
use proptest::prelude::*;

fn dims(max_rank: usize, max: i64) -> impl Strategy<Value = Vec<i64>> {
    prop::collection::vec(1..=max, 0..=max_rank)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// broadcast_in_dim into a shape with new dimensions inserted: the
    /// result has the target shape and each element is the operand's at
    /// the mapped index.
    #[test]
    fn broadcast_in_dim_maps_every_element(shape in dims(3, 4), extra in prop::collection::vec((0usize..4, 1i64..4), 0..3), seed in 0u64..1000) {
        // Target: the operand's dims in order, with extra dims inserted.
        let mut target: Vec<(i64, Option<usize>)> = shape.iter().enumerate().map(|(i, &d)| (d, Some(i))).collect();
        for (at, size) in &extra {
            let at = (*at).min(target.len());
            target.insert(at, (*size, None));
        }
        let out_dims: Vec<i64> = target.iter().map(|t| t.0).collect();
        let mapping: Vec<i64> = target.iter().enumerate().filter_map(|(k, t)| t.1.map(|_| k as i64)).collect();
        let ty = TensorType::new(DType::F32, shape.clone());
        let f = trace("b", &[("x", ty.clone())], |i| vec![("y", i["x"].broadcast_in_dim(&out_dims, &mapping))]).unwrap();
        prop_assert_eq!(&f.output_types()[0].dims, &out_dims);
        let x = Rng::from_state(seed).literal(ty, -1.0, 1.0);
        let y = interpret(&f, std::slice::from_ref(&x)).unwrap().remove(0).to_f64s();
        let xv = x.to_f64s();
        let strides = |d: &[i64]| -> Vec<i64> {
            let mut s = vec![1i64; d.len()];
            for k in (0..d.len().saturating_sub(1)).rev() { s[k] = s[k + 1] * d[k + 1]; }
            s
        };
        let (so, si) = (strides(&out_dims), strides(&shape));
        for (flat, v) in y.iter().enumerate() {
            let idx: Vec<i64> = (0..out_dims.len()).map(|k| (flat as i64 / so[k]) % out_dims[k]).collect();
            let src: i64 = mapping.iter().enumerate().map(|(i, &m)| idx[m as usize] * si[i]).sum();
            prop_assert_eq!(*v, xv[src as usize]);
        }
    }

    /// Elementwise ops broadcast as NumPy does (trailing dimensions
    /// aligned, each pair equal or one of them 1); shapes that do not
    /// broadcast are a trace error naming the op, never a panic.
    #[test]
    fn elementwise_ops_broadcast_as_numpy(a in dims(3, 3), b in dims(3, 3), seed in 0u64..1000) {
        let rank = a.len().max(b.len());
        let pad = |d: &[i64]| -> Vec<i64> { let mut v = vec![1; rank - d.len()]; v.extend_from_slice(d); v };
        let (pa, pb) = (pad(&a), pad(&b));
        let want: Option<Vec<i64>> = pa.iter().zip(&pb).map(|(&x, &y)| {
            if x == y || y == 1 { Some(x) } else if x == 1 { Some(y) } else { None }
        }).collect();
        let (ta, tb) = (TensorType::new(DType::F32, a.clone()), TensorType::new(DType::F32, b.clone()));
        let r = trace("e", &[("a", ta.clone()), ("b", tb.clone())], |i| vec![("y", i["a"] * i["b"])]);
        match (r, want) {
            (Ok(f), Some(w)) => {
                prop_assert_eq!(&f.output_types()[0].dims, &w);
                // And the values: y[idx] = a[idx mod a] * b[idx mod b].
                let mut rng = Rng::from_state(seed);
                let (la, lb) = (rng.literal(ta, -2.0, 2.0), rng.literal(tb, -2.0, 2.0));
                let y = interpret(&f, &[la.clone(), lb.clone()]).unwrap().remove(0).to_f64s();
                let (va, vb) = (la.to_f64s(), lb.to_f64s());
                let at = |v: &[f64], d: &[i64], idx: &[i64]| {
                    let mut flat = 0;
                    for k in 0..rank { flat = flat * d[k] + if d[k] == 1 { 0 } else { idx[k] }; }
                    v[flat as usize]
                };
                for (flat, got) in y.iter().enumerate() {
                    let mut rest = flat as i64;
                    let mut idx = vec![0; rank];
                    for k in (0..rank).rev() { idx[k] = rest % w[k]; rest /= w[k]; }
                    let expect = (at(&va, &pa, &idx) as f32 * at(&vb, &pb, &idx) as f32) as f64;
                    prop_assert_eq!(*got, expect);
                }
            }
            (Err(e), None) => prop_assert!(e.to_string().contains("do not broadcast"), "{}", e),
            (r, w) => prop_assert!(false, "{:?} {:?}: {:?} vs {:?}", a, b, r.map(|f| f.output_types()), w),
        }
    }

    /// reshape keeps the element count or is an error.
    #[test]
    fn reshape_keeps_the_element_count(a in dims(3, 4), b in dims(3, 4)) {
        let r = trace("r", &[("a", TensorType::new(DType::F32, a.clone()))], |i| vec![("y", i["a"].reshape(&b))]);
        let (na, nb) = (a.iter().product::<i64>(), b.iter().product::<i64>());
        prop_assert_eq!(r.is_ok(), na == nb);
    }

    /// dot_general: batch dims, then the lhs's and rhs's free dims.
    #[test]
    fn dot_general_shape(batch in dims(2, 3), m in dims(2, 3), k in dims(2, 3), n in dims(2, 3)) {
        let nb = batch.len() as i64;
        let lhs: Vec<i64> = batch.iter().chain(&m).chain(&k).copied().collect();
        let rhs: Vec<i64> = batch.iter().chain(&k).chain(&n).copied().collect();
        let dims = hlo_ir::ops::DotGeneral {
            lhs_batch: (0..nb).collect(),
            rhs_batch: (0..nb).collect(),
            lhs_contracting: (nb + m.len() as i64..nb + (m.len() + k.len()) as i64).collect(),
            rhs_contracting: (nb..nb + k.len() as i64).collect(),
            precision: None,
            preferred_element_type: None,
        };
        let f = trace("d", &[("l", TensorType::new(DType::F32, lhs)), ("r", TensorType::new(DType::F32, rhs))], |i| vec![("y", i["l"].dot_general(i["r"], dims.clone()))]).unwrap();
        let want: Vec<i64> = batch.iter().chain(&m).chain(&n).copied().collect();
        prop_assert_eq!(&f.output_types()[0].dims, &want);
    }

    /// A spec validates exactly when every axis exists, none is used twice
    /// and each dimension divides by its axes' product.
    #[test]
    fn spec_validation(sizes in prop::collection::vec(1i64..5, 3), shape in prop::collection::vec(1i64..13, 1..4), picks in prop::collection::vec(prop::collection::vec(0usize..4, 0..3), 0..4)) {
        let names = ["dp", "fsdp", "mp", "zz"];
        let mesh = Mesh::new(&[("dp", sizes[0]), ("fsdp", sizes[1]), ("mp", sizes[2])]).unwrap();
        let spec_dims: Vec<Vec<&str>> = picks.iter().map(|p| p.iter().map(|&i| names[i]).collect()).collect();
        let refs: Vec<&[&str]> = spec_dims.iter().map(Vec::as_slice).collect();
        let spec = PartitionSpec::new(&refs);
        let mut seen = std::collections::HashSet::new();
        let mut expect_ok = spec_dims.len() <= shape.len();
        let mut kind = "";
        if !expect_ok { kind = "rank"; }
        for (d, axes) in spec_dims.iter().enumerate() {
            if !expect_ok { break; }
            let mut parts = 1;
            for a in axes {
                if *a == "zz" { expect_ok = false; kind = "unknown"; break; }
                if !seen.insert(*a) { expect_ok = false; kind = "twice"; break; }
                parts *= mesh.axis_size(a).unwrap();
            }
            if expect_ok && shape[d] % parts != 0 { expect_ok = false; kind = "divisible"; }
        }
        let got = spec.validate(&mesh, &shape, "t");
        prop_assert_eq!(got.is_ok(), expect_ok, "{:?} {:?} {:?}", spec_dims, shape, got);
        if let Err(e) = got {
            let matches = matches!((&e, kind),
                (ShardingError::RankMismatch { .. }, "rank")
                | (ShardingError::UnknownAxis { .. }, "unknown")
                | (ShardingError::AxisTwice { .. }, "twice")
                | (ShardingError::NotDivisible { .. }, "divisible"));
            prop_assert!(matches, "{} for {}", e, kind);
            prop_assert!(e.to_string().contains("`t`") || e.to_string().contains('t'));
        }
    }

    /// A mesh prints as it parses.
    #[test]
    fn mesh_round_trip(sizes in prop::collection::vec(1i64..9, 1..4)) {
        let names = ["dp", "fsdp", "mp"];
        let axes: Vec<(&str, i64)> = sizes.iter().enumerate().map(|(i, &s)| (names[i], s)).collect();
        let mesh = Mesh::new(&axes).unwrap();
        prop_assert_eq!(mesh.to_string().parse::<Mesh>().unwrap(), mesh);
    }
}
