"""How far the probe's second check sees other rows move on mixtures of experts of a real width (`KERNEL_TOL`, nbs/01c_probe.ipynb).

Usage: python tools/moe_roundoff.py [--width D] [--batch B] [--seq L]

An MoE expert's matmul runs on the tokens routed to it, so changing rows 0…h−1 (or poisoning row 0) changes how many rows
each expert's kernel sees, and the other rows' outputs may move by round-off. The probe (`capskip.engine.probe`)
ignores a move within `KERNEL_TOL` of the output's scale. This tool runs the probe on two-block Mixtral, Qwen2-MoE,
GraniteMoe and GPT-OSS models of width D (8 experts, 2 per token, float32, random weights from a seeded config) and
prints, per family and perturbation, the largest move of the other rows over their largest magnitude, next to
`KERNEL_TOL`; the probe passes each model (or the tool says which refusal it met)."""
import argparse

import torch

import capskip.engine.probe as probe


def models(width: int) -> dict:
    import transformers as tf
    ffn, vocab = 2 * width, 1024
    common = dict(vocab_size=vocab, hidden_size=width, num_hidden_layers=2, num_attention_heads=width // 64,
                  num_key_value_heads=max(1, width // 256), max_position_embeddings=1024, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0)
    return {
        'Mixtral': lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**common, intermediate_size=ffn, num_local_experts=8,
                                                                 num_experts_per_tok=2)),
        'Qwen2-MoE': lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, intermediate_size=ffn, num_experts=8,
                                                                     num_experts_per_tok=2, moe_intermediate_size=ffn // 4,
                                                                     shared_expert_intermediate_size=ffn)),
        'GraniteMoe': lambda: tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(**common, intermediate_size=ffn,
                                                                          num_local_experts=8, num_experts_per_tok=2)),
        'GPT-OSS': lambda: tf.GptOssForCausalLM(tf.GptOssConfig(**common, intermediate_size=ffn, num_local_experts=8,
                                                                num_experts_per_tok=2, head_dim=64, sliding_window=128)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--width', type=int, default=512); ap.add_argument('--batch', type=int, default=8)
    ap.add_argument('--seq', type=int, default=64)
    ns = ap.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    tol = probe.KERNEL_TOL[4]
    seen: list = []
    inner = probe._beyond_kernels
    def measured(clean, out, batch, rows):          # the probe's own comparison, with its ratio written down
        others = probe._others(batch, rows)
        for u, v in zip(probe._tensors(clean), probe._tensors(out)):
            if u.is_floating_point() and u.ndim and u.shape[0] == batch and v.shape == u.shape:
                a, b = u[others].double(), v[others].double()
                seen.append(('row 0 NaN' if len(rows) == 1 else f'rows 0-{len(rows) - 1} changed',
                             float((b - a).abs().max()) / max(float(a.abs().max()), 1e-30)))
        return inner(clean, out, batch, rows)
    probe._beyond_kernels = measured
    print(f'width {ns.width}, batch {ns.batch} x {ns.seq} tokens, float32; KERNEL_TOL (float32) = {tol:.0e} of the output\'s scale')
    print(f'{"family":11s} {"perturbation":18s} {"largest move / scale":>21s}  probe')
    for name, make in models(ns.width).items():
        torch.manual_seed(0)
        model = make().float().train()
        ids = torch.randint(1, 1024, (ns.batch, ns.seq), generator=torch.Generator().manual_seed(0))
        seen.clear()
        try: probe.probe_modules(model, ids); verdict = 'passed'
        except Exception as e: verdict = f'refused: {str(e)[:80]}'
        if not seen: print(f'{name:11s} {"(no row moved)":18s} {"0":>21s}  {verdict}')
        for what, ratio in seen: print(f'{name:11s} {what:18s} {ratio:21.1e}  {verdict}')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
