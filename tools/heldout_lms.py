"""Causal LMs the tests do not build, through `CAPSkip` in every skipping mode, against plain float64 autograd (a
maintainers' probe).

Usage: python tools/heldout_lms.py [NAME ...] [--more]   (default: every name in ARCHS; --more adds the families of MORE)

Each model is a two-block Hugging Face model built from its config (hidden 32, vocab 64; no weights are downloaded). One
batch of 6 right-padded rows of 8 tokens (Hugging Face labels, -100 on padding; `--pad left` pads on the left, `--pad
none` keeps every token, `--prompt N` also masks the first N labels as an SFT prompt) goes through `CAPSkip(model, budget=0.5, mode=M)`:
`skip.loss(skip(**batch)).backward()`. Printed per model and mode: the rows kept and the zero-gradient-safe errors
(`capskip.testing.grad_errors`: worst parameter, global) against `capskip.testing.oracles.sequence_grads`, plain autograd
of the kept rows' loss on a float64 copy; or, for a model capskip refuses, the first line of its refusal. The float64
reference needs every op in float64: a mixture-of-experts model's grouped matrix product has none, so its rows are
compared with float32 autograd of the kept rows instead (and say so); a model whose own float64 gradient is not finite
says that (Gemma 2 on padded rows: use `--pad none`).
"""
import argparse, sys, warnings

import torch

ARCHS = ('gemma', 'gemma2', 'gemma3', 'mistral', 'phi', 'phi3', 'qwen3', 'olmo2', 'gptneox', 'falcon', 'stablelm',
         'bloom', 'opt', 'cohere', 'granite', 'doge', 'mixtral', 'qwen2moe')
# more families, each built by `from_config` from the transformers classes `<Name>Config` / `<Name>ForCausalLM` with the
# keywords of `SMALL` its config takes, plus its own (hybrid models need an attention layer among their two)
MORE = {'GPTJ': {}, 'GPTBigCode': {}, 'CodeGen': {}, 'BioGpt': {}, 'Persimmon': {}, 'Starcoder2': {}, 'Olmo': {},
        'Nemotron': {}, 'Glm': {}, 'Glm4': {}, 'Helium': {}, 'Exaone4': {}, 'Arcee': {}, 'SmolLM3': {}, 'Cohere2': {},
        'Apertus': {}, 'Ministral': {}, 'Olmo3': {}, 'Mpt': {}, 'Mamba': {}, 'Lfm2': {}, 'FalconH1': {}, 'Ernie4_5': {},
        'Mamba2': {'num_heads': 8, 'head_dim': 8, 'n_groups': 1, 'expand': 2},
        'Bamba': {'mamba_n_heads': 8, 'mamba_d_head': 8, 'attn_layer_indices': [1], 'mamba_n_groups': 1},
        'RecurrentGemma': {'block_types': ['recurrent', 'attention'], 'lru_width': 32, 'attention_window_size': 4},
        'GraniteMoe': {}, 'GptOss': {},
        'Jamba': {'attn_layer_offset': 1, 'attn_layer_period': 2, 'expert_layer_offset': 1, 'expert_layer_period': 2,
                  'use_mamba_kernels': False},
        'Qwen3Next': {'layer_types': ['linear_attention', 'full_attention'], 'linear_num_value_heads': 2,
                      'linear_num_key_heads': 2, 'linear_key_head_dim': 8, 'linear_value_head_dim': 8}}
SMALL = dict(vocab_size=64, hidden_size=32, n_embd=32, d_model=32, num_hidden_layers=2, n_layer=2, n_layers=2,
             num_attention_heads=4, n_head=4, n_heads=4, num_key_value_heads=2, intermediate_size=64, n_inner=64,
             max_position_embeddings=16, n_positions=16, bos_token_id=0, eos_token_id=0, pad_token_id=0, head_dim=8,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attention_dropout=0.0, hidden_dropout=0.0, dropout=0.0,
             state_size=8, expand=2, num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             rotary_dim=4, partial_rotary_factor=0.5, sliding_window=4)


def from_config(name: str):
    "A two-block `<name>ForCausalLM` of `MORE` from its config: the keywords of `SMALL` its config's constructor takes, and its own."
    import inspect
    import transformers as tf
    torch.manual_seed(0)
    config = getattr(tf, name + 'Config')
    takes = inspect.signature(config.__init__).parameters
    kw = {k: v for k, v in SMALL.items() if k in takes} | MORE[name]
    return getattr(tf, name + 'ForCausalLM')(config(**kw))
B, L, VOCAB = 6, 8, 64
LENGTHS = torch.tensor([8, 6, 8, 3, 8, 5])


def build(name: str):
    "A two-block model of `name` from its config, the same weights on every call."
    if name in MORE: return from_config(name)
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    plain = {k: v for k, v in common.items() if k != 'num_key_value_heads'}
    small = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, bos_token_id=0, eos_token_id=0)
    makers = {
        'gemma': lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**common, head_dim=8)),
        'gemma2': lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=8, final_logit_softcapping=30.0,
                                                              attn_logit_softcapping=50.0, sliding_window=4,
                                                              attn_implementation='eager')),
        'gemma3': lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, head_dim=8, sliding_window=4)),
        'mistral': lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=4)),
        'phi': lambda: tf.PhiForCausalLM(tf.PhiConfig(**plain, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
        'phi3': lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**common, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
        'qwen3': lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=8)),
        'olmo2': lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**common)),
        'gptneox': lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**plain)),
        'falcon': lambda: tf.FalconForCausalLM(tf.FalconConfig(**small, hidden_dropout=0.0, attention_dropout=0.0)),
        'stablelm': lambda: tf.StableLmForCausalLM(tf.StableLmConfig(**common)),
        'bloom': lambda: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                                                            bos_token_id=0, eos_token_id=0, pad_token_id=0)),
        'opt': lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                      num_attention_heads=4, max_position_embeddings=16,
                                                      word_embed_proj_dim=32, dropout=0.0, bos_token_id=0,
                                                      eos_token_id=0, pad_token_id=1)),
        'cohere': lambda: tf.CohereForCausalLM(tf.CohereConfig(**common, logit_scale=0.0625)),
        'granite': lambda: tf.GraniteForCausalLM(tf.GraniteConfig(**common, logits_scaling=4.0, embedding_multiplier=2.0,
                                                                   residual_multiplier=0.5, attention_multiplier=0.25)),
        'doge': lambda: tf.DogeForCausalLM(tf.DogeConfig(**common, attention_dropout=0.0, hidden_dropout=0.0)),
        'mixtral': lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)),
        'qwen2moe': lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                                     moe_intermediate_size=16,
                                                                     shared_expert_intermediate_size=32)),
    }
    return makers[name]()


def batch(pad: str, prompt: int) -> dict:
    "Padded ids, their attention mask and Hugging Face's labels (= input_ids, -100 on padding and on the prompt)."
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (B, L), generator=g)
    mask = (torch.arange(L)[None] < LENGTHS[:, None]).long()
    if pad == 'none': mask = torch.ones_like(mask)
    if pad == 'left': mask = mask.flip(1)
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, :prompt] = -100
    return {'input_ids': ids, 'attention_mask': mask, 'labels': labels}


def probe(name: str, mode: str, pad: str, prompt: int) -> str:
    from capskip import CAPSkip
    from capskip.engine.check import model_grads
    from capskip.testing import grad_errors
    from capskip.testing.oracles import sequence_grads
    data = batch(pad, prompt)
    try:
        model = build(name)
        skip = CAPSkip(model, budget=0.5, mode=mode)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            skip.loss(skip(**data)).backward()
        got, applied = model_grads(model), skip.last.applied
        skip.close()
    except Exception as err:
        return f'refused: {type(err).__name__}: {str(err).splitlines()[0][:150]}'
    inputs = {k: data[k] for k in ('input_ids', 'attention_mask')}
    aligned = torch.cat([data['labels'][:, 1:], torch.full_like(data['labels'][:, :1], -100)], 1)
    against = ''
    try: ref = sequence_grads(build(name), inputs, aligned, applied)
    except Exception as err:
        try: ref = float32_grads(build(name), inputs, aligned, applied)
        except Exception: return f'kept {int((applied > 0).sum())}; no float64 reference: {type(err).__name__}: {str(err).splitlines()[0][:90]}'
        against = f' (against float32 autograd: no float64 {str(err).splitlines()[0][:60]})'
    if not all(torch.isfinite(g).all() for g in ref.values()):
        return f'kept {int((applied > 0).sum())}; no float64 reference: the float64 model\'s own gradient is not finite'
    top, rel = grad_errors(got, ref)
    return f'kept {int((applied > 0).sum())}, worst {top:.1e}, global {rel:.1e}{against}'


def float32_grads(model, inputs: dict, labels, applied) -> dict:
    "`sequence_grads`' objective on the float32 model itself, for a model with an op that has no float64 kernel."
    import torch.nn.functional as F
    from capskip.engine.check import model_grads
    from capskip.testing.oracles import call_model
    model.zero_grad(set_to_none=True)
    z = call_model(model, inputs)
    tok = F.cross_entropy(z.flatten(0, 1), labels.flatten(), reduction='none').view(labels.shape)
    ((tok.sum(1) * applied.to(tok.dtype)).sum() / (labels != -100).sum().clamp_min(1)).backward()
    return model_grads(model)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('names', nargs='*'); ap.add_argument('--pad', choices=('right', 'left', 'none'), default='right')
    ap.add_argument('--prompt', type=int, default=0)
    ap.add_argument('--more', action='store_true', help='with no NAME: also every family of MORE (about 3 more minutes)')
    ns = ap.parse_args()
    unknown = [n for n in ns.names if n not in ARCHS and n not in MORE]
    if unknown: ap.error(f'unknown model {unknown[0]!r}: one of {", ".join(ARCHS)}, or with --more: {", ".join(MORE)}')
    if not 0 <= ns.prompt < L: ap.error(f'--prompt must be in [0, {L}), got {ns.prompt}')
    import transformers
    transformers.logging.set_verbosity_error()
    print(f'torch {torch.__version__}, transformers {transformers.__version__}; B={B}, L={L}, V={VOCAB}, budget 0.5, '
          f'{"not padded" if ns.pad == "none" else ns.pad + "-padded"}, prompt {ns.prompt}; errors against float64 autograd of the kept rows', flush=True)
    for name in ns.names or (ARCHS + tuple(MORE) if ns.more else ARCHS):
        for mode in ('reuse', 'reforward', 'masked'):
            print(f'{name:9s} {mode:9s} {probe(name, mode, ns.pad, ns.prompt)}', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
