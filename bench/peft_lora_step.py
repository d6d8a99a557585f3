"""Peer benchmark on a GPU: one LoRA finetuning step of PyTorch + PEFT.

Llama 3.2 1B or Llama 3.1 8B shapes (random bf16 base weights, SDPA
attention), LoRA r=16 / alpha 32 on all seven projections with f32 adapters,
AdamW, global-norm clipping at 1.0; prints the median step time, tokens/s and
peak memory of steps 3 onwards. Used by bench/gpu.sh:

    python3 bench/peft_lora_step.py {1b|8b} BATCH SEQ STEPS [sft|dpo]

With `dpo`, the step is DPO's as TRL computes it for a fresh adapter:
the BATCH rows are BATCH/2 pairs (chosen rows, then rejected), one policy
forward over all of them, one reference forward with the adapter disabled
and without gradients, summed log-probs of every token, the sigmoid loss
with beta 0.1.
"""
import statistics
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, head_dim=64, tie_word_embeddings=True, factor=32.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, head_dim=128, tie_word_embeddings=False, factor=8.0),
}


def row_logps(logits, ids):
    """Each row's summed log-probability of its tokens after the first."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return torch.gather(logp, 2, ids[:, 1:, None]).squeeze(2).sum(1)


def dpo_loss(model, ids, beta=0.1):
    """DPO's sigmoid loss over pairs (rows 0..P chosen, P..2P rejected)."""
    pairs = ids.shape[0] // 2
    policy = row_logps(model(input_ids=ids).logits, ids)
    with torch.no_grad(), model.disable_adapter():
        reference = row_logps(model(input_ids=ids).logits, ids)
    h = (policy[:pairs] - reference[:pairs]) - (policy[pairs:] - reference[pairs:])
    return -torch.nn.functional.logsigmoid(beta * h).mean()


def main():
    size, b, s, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    objective = sys.argv[5] if len(sys.argv) > 5 else "sft"
    shape = dict(SHAPES[size])
    factor = shape.pop("factor")
    cfg = LlamaConfig(vocab_size=128256, num_key_value_heads=8, rope_theta=500000.0,
                      max_position_embeddings=131072, attn_implementation="sdpa",
                      rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192},
                      **shape)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=2e-4)
    ids = torch.randint(0, 128256, (b, s), device="cuda")
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        if objective == "dpo":
            loss = dpo_loss(model, ids)
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    t = statistics.median(times[2:])
    print(f"PyTorch+PEFT {size.upper()} LoRA {objective} batch {b} x seq {s}: median step {t * 1e3:.1f} ms, "
          f"{b * s / t:.0f} tokens/s, peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
