"""The scan behind nbs/01c_probe.ipynb's statements that no common architecture keeps a module output past its forward
and that none but BatchNorm keeps updating buffers (a maintainers' helper): `capskip.engine.probe.kept_outputs` and
`updated_buffers` on 15 timm, 15 torchvision and 13 Hugging Face models built from configs (no weights), in train mode.
A model listed with anything kept, or with buffers updated outside BatchNorm, would be refused by reuse and reforward
(BatchNorm in train mode is refused before, as row-dependent: its running statistics are counted apart).

Usage: python tools/kept_outputs_scan.py
"""
import warnings

import torch

from capskip.engine.probe import kept_outputs, updated_buffers

TIMM = ['resnet18', 'vit_tiny_patch16_224', 'convnext_atto', 'efficientnet_b0', 'mobilenetv3_small_050', 'regnetx_002',
        'deit_tiny_patch16_224', 'swin_tiny_patch4_window7_224', 'levit_128s', 'coat_lite_tiny', 'mixer_s16_224',
        'resmlp_12_224', 'poolformer_s12', 'edgenext_xx_small', 'maxvit_nano_rw_256']
TORCHVISION = ['resnet18', 'mobilenet_v2', 'vgg11', 'googlenet', 'inception_v3', 'densenet121', 'squeezenet1_0',
               'shufflenet_v2_x0_5', 'vit_b_16', 'swin_t', 'convnext_tiny', 'efficientnet_b0', 'regnet_x_400mf',
               'mnasnet0_5', 'maxvit_t']


def hf_models():
    "(name, model) of 10 causal LMs and 3 encoders, tiny configs."
    import transformers as tf
    tf.logging.set_verbosity_error()
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    causal = {'gpt2': tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2),
              'llama': tf.LlamaConfig(**small, num_key_value_heads=2), 'qwen2': tf.Qwen2Config(**small, num_key_value_heads=2),
              'mistral': tf.MistralConfig(**small, num_key_value_heads=2), 'phi': tf.PhiConfig(**small),
              'gemma': tf.GemmaConfig(**small, num_key_value_heads=2, head_dim=8),
              'opt': tf.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                  word_embed_proj_dim=32),
              'gpt_neox': tf.GPTNeoXConfig(**small), 'bloom': tf.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4),
              'mixtral': tf.MixtralConfig(**small, num_key_value_heads=2, num_local_experts=4)}
    for name, cfg in causal.items(): yield f'hf:{name}', tf.AutoModelForCausalLM.from_config(cfg)
    enc = {'bert': tf.BertConfig(**small), 'roberta': tf.RobertaConfig(**small),
           'distilbert': tf.DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64)}
    for name, cfg in enc.items(): yield f'hf:{name}', tf.AutoModelForSequenceClassification.from_config(cfg)


def probed(model, x) -> tuple:
    "(outputs kept past the forward, buffers updated outside BatchNorm, BatchNorm buffers updated)."
    bn = {n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    updated = updated_buffers(model, x)
    other = [b for b in updated if b.rsplit('.', 1)[0] not in bn]
    return kept_outputs(model, x), other, len(updated) - len(other)


def main():
    import timm, torchvision
    warnings.simplefilter('ignore')
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in TIMM:
        m = timm.create_model(name, num_classes=10, pretrained=False).train()
        rows.append((f'timm:{name}', *probed(m, torch.randn(2, 3, *m.default_cfg['input_size'][1:], generator=gen))))
    for name in TORCHVISION:
        kw = {'aux_logits': False, 'init_weights': False} if name in ('googlenet', 'inception_v3') else {}
        m = getattr(torchvision.models, name)(num_classes=10, **kw).train()
        side = 299 if name == 'inception_v3' else 224
        rows.append((f'torchvision:{name}', *probed(m, torch.randn(2, 3, side, side, generator=gen))))
    for name, m in hf_models():
        rows.append((name, *probed(m.train(), torch.randint(0, 64, (2, 8), generator=gen))))
    for name, kept, other, bn in rows:
        print(f'{name:36s} {", ".join(kept) if kept else "nothing kept":16s}  buffers updated: '
              f'{", ".join(other[:3]) if other else "none"}{f" (and {bn} of BatchNorm)" if bn else ""}')
    print(f'{sum(not k for _, k, _, _ in rows)} of {len(rows)} models keep nothing past the forward; '
          f'{sum(not o for _, _, o, _ in rows)} of {len(rows)} update no buffer outside BatchNorm')


if __name__ == '__main__': main()
