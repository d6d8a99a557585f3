//! DeepSeek-V3's multi-head latent attention (`DeepseekV3Attention`,
//! see [`MlaConfig`]): the query, key and value heads it makes, in the
//! layout every attention form here takes (`[b, heads, t, head_dim]`, the
//! values padded with zeros to the keys' width), and its output cut back
//! to the values' width for `o_proj`.

use hlo_ir::{scope, Tensor};

use super::config::MlaConfig;
use super::model::{Decoder, Params};

/// `x` split along its last dimension at `at`: (`[.., :at]`, `[.., at:]`).
fn split_last(x: Tensor, at: i64) -> (Tensor, Tensor) {
    let d = x.dims();
    let last = d.len() - 1;
    let start = vec![0; d.len()];
    let (mut upto, mut from) = (d.clone(), start.clone());
    upto[last] = at;
    from[last] = at;
    (x.slice(&start, &upto), x.slice(&from, &d))
}

/// Rotary dimensions laid out in interleaved pairs `(x0, x1), (x2, x3),
/// ...` reordered evens first, then odds: what `rotate_half` turns as
/// HF's `apply_rotary_pos_emb_interleave` turns the pairs.
fn deinterleave(x: Tensor) -> Tensor {
    let d = x.dims();
    let r = d.len();
    let mut pairs = d.clone();
    pairs[r - 1] /= 2;
    pairs.push(2);
    let mut order: Vec<i64> = (0..r as i64 - 1).collect();
    order.extend([r as i64, r as i64 - 1]);
    x.reshape(&pairs).transpose(&order).reshape(&d)
}

impl Decoder<'_> {
    /// The query, key and value heads of `x: [b, t, hidden]` under latent
    /// attention `m` at `prefix` (`model.layers.3.self_attn`), `[b,
    /// heads, t, head_dim]` each, `rope` applied to the rotary parts,
    /// `proj(module, short, x)` as each projection.
    pub(super) fn latent_qkv(
        &self,
        p: &Params,
        prefix: &str,
        x: Tensor,
        m: MlaConfig,
        rope: &dyn Fn(Tensor) -> Tensor,
        proj: &dyn Fn(&str, &str, Tensor) -> Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let c = self.config;
        let (b, t) = (x.dims()[0], x.dims()[1]);
        let (heads, hd) = (c.num_attention_heads, c.head_dim);
        let at = |short: &str| format!("{prefix}.{short}");
        let norm = |name: &str, y: Tensor| scope(name, || self.norm(p, &at(name), y));
        let q = match m.q_lora_rank {
            Some(_) => {
                let a = proj(&at("q_a_proj"), "q_a_proj", x);
                proj(&at("q_b_proj"), "q_b_proj", norm("q_a_layernorm", a))
            }
            None => proj(&at("q_proj"), "q_proj", x),
        };
        let by_head = |y: Tensor, n: i64, w: i64| y.reshape(&[b, t, n, w]).transpose(&[0, 2, 1, 3]);
        let (q_pass, q_rot) = split_last(by_head(q, heads, hd), m.qk_nope_head_dim);
        let compressed = proj(&at("kv_a_proj_with_mqa"), "kv_a_proj_with_mqa", x);
        let (latent, k_rot) = split_last(compressed, m.kv_lora_rank);
        let latent = norm("kv_a_layernorm", latent);
        // One rotary key head, shared by every query head.
        let k_rot = by_head(k_rot, 1, m.qk_rope_head_dim);
        let turn = |y: Tensor| match m.rope_interleave {
            true => rope(deinterleave(y)),
            false => rope(y),
        };
        let (q_rot, k_rot) = (turn(q_rot), turn(k_rot));
        let kv = proj(&at("kv_b_proj"), "kv_b_proj", latent);
        let kv = by_head(kv, heads, m.qk_nope_head_dim + m.v_head_dim);
        let (k_pass, v) = split_last(kv, m.qk_nope_head_dim);
        let rot_dims = [b, heads, t, m.qk_rope_head_dim];
        let k_rot = k_rot.broadcast_in_dim(&rot_dims, &[0, 1, 2, 3]);
        let q = Tensor::concat(&[q_pass, q_rot], 3);
        let k = Tensor::concat(&[k_pass, k_rot], 3);
        let pad = hd - m.v_head_dim;
        let v = match pad {
            0 => v,
            _ => v.pad(v.scalar_like(0.0), &[0; 4], &[0, 0, 0, pad], &[0; 4]),
        };
        (q, k, v)
    }

    /// The attention's output `[b, t, heads·head_dim]` as `o_proj` takes
    /// it: under latent attention, each head's first `v_head_dim` values
    /// (the rest are the zeros the values were padded with).
    pub(super) fn attention_output(&self, out: Tensor) -> Tensor {
        let c = self.config;
        let Some(m) = c.mla.filter(|m| m.v_head_dim < c.head_dim) else {
            return out;
        };
        let d = out.dims();
        let heads = c.num_attention_heads;
        let by_head = out.reshape(&[d[0], d[1], heads, c.head_dim]);
        let (values, _) = split_last(by_head, m.v_head_dim);
        values.reshape(&[d[0], d[1], heads * m.v_head_dim])
    }
}
