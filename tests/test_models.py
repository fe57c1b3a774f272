"""capskip.runs.models: registry forwards, heads, local pretrained loading, BatchNorm -> GroupNorm."""
import pytest
import torch
from torch import nn

from capskip.engine.head import find_head
from capskip.runs.models import (batchnorm_to_groupnorm, create_model, largest_divisor, list_models, load_pretrained,
                                 read_state_dict)

CASES = {'resnet18_gn': ({}, (3, 3, 16, 16)), 'deit_s': ({'img_size': 32}, (3, 3, 32, 32)),
         'vit_tiny': ({}, (3, 3, 32, 32)), 'digits_cnn': ({'in_chans': 1}, (3, 1, 16, 16))}


def _no_batchnorm(model):
    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize('name', sorted(CASES))
def test_registry_model_forward_head_and_row_independence(name):
    kw, shape = CASES[name]
    torch.manual_seed(0)
    model = create_model(name, num_classes=6, **kw)
    last = list(model.modules())[-1]
    assert type(last) is nn.Linear and last is find_head(model) and last.out_features == 6
    nn.init.normal_(last.weight, std=0.1)  # deit_s starts at zero: make the check below informative
    assert _no_batchnorm(model)
    model.train() if name in ('resnet18_gn', 'digits_cnn') else model.eval()  # ViTs: drop path is random in train
    x = torch.randn(*shape)
    out = model(x)
    assert out.shape == (3, 6) and torch.isfinite(out).all()
    # rows are independent: each row's logits alone equal its logits in the batch
    alone = torch.cat([model(x[i:i + 1]) for i in range(3)])
    assert torch.allclose(out, alone, atol=1e-4, rtol=1e-4)
    assert out.std() > 0


def test_list_models_names_the_contract():
    names = list_models()
    for name in ('resnet18_gn', 'deit_s', 'vit_tiny', 'digits_cnn', 'timm:<name>', 'torchvision:<name>'):
        assert name in names
    assert list_models('*vit*') == ['vit_tiny'] and list_models('timm:*') == ['timm:<name>']


def test_resnet18_gn_structure():
    model = create_model('resnet18_gn', num_classes=100)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1) and isinstance(model.maxpool, nn.Identity)
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == 20 and all(m.num_groups == 32 for m in norms)
    feats = {}
    model.layer4.register_forward_hook(lambda m, i, o: feats.update(l4=o.shape))
    model.eval()(torch.randn(1, 3, 32, 32))
    assert feats['l4'] == (1, 512, 4, 4)  # CIFAR stem: 32 px -> 4x4 at the last stage (ImageNet stem gives 1x1)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(11.2e6, rel=0.02)
    assert create_model('resnet18_gn', num_classes=10, in_chans=1).conv1.in_channels == 1
    fan_out = 64 * 9  # the CIFAR stem is initialised like torchvision's convs (Kaiming normal, fan-out)
    assert model.conv1.weight.std().item() == pytest.approx((2 / fan_out) ** 0.5, rel=0.1)


def test_deit_s_defaults():
    model = create_model('deit_s', num_classes=100, img_size=32)
    assert model.head.weight.abs().sum() == 0 and model.head.bias.abs().sum() == 0
    assert model.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)
    assert model.embed_dim == 384 and len(model.blocks) == 12 and model.blocks[0].attn.num_heads == 6
    assert create_model('deit_s', img_size=32, drop_path_rate=0.0).blocks[-1].drop_path1.__class__ is nn.Identity


def _randomise_head(model):
    nn.init.normal_(find_head(model).weight)
    nn.init.normal_(find_head(model).bias)
    return model


@pytest.mark.parametrize('fmt', ['pth', 'wrapped', 'safetensors'])
def test_deit_s_loads_local_weights_and_drops_the_head(tmp_path, fmt):
    torch.manual_seed(1)
    source = _randomise_head(create_model('deit_s', num_classes=10, img_size=32))
    state = source.state_dict()
    path = tmp_path / f'w.{"safetensors" if fmt == "safetensors" else "pth"}'
    if fmt == 'safetensors':
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save({'model': state, 'epoch': 3} if fmt == 'wrapped' else state, path)
    torch.manual_seed(2)
    model = create_model('deit_s', num_classes=5, img_size=32, pretrained=str(path))
    mine = model.state_dict()
    body = [k for k in state if not k.startswith('head.')]
    assert len(body) > 100 and all(torch.equal(mine[k], state[k]) for k in body)
    assert model.head.weight.shape == (5, 384) and model.head.weight.abs().sum() == 0


def test_pretrained_position_embeddings_are_resampled(tmp_path):
    source = create_model('vit_tiny', num_classes=10, img_size=32)
    torch.save(source.state_dict(), tmp_path / 'w.pt')
    model = create_model('vit_tiny', num_classes=10, img_size=64, pretrained=tmp_path / 'w.pt')
    assert model.pos_embed.shape == (1, 1 + 16, 192)
    assert torch.equal(model.pos_embed[:, 0], source.pos_embed[:, 0])  # class token position kept
    assert model.eval()(torch.randn(1, 3, 64, 64)).shape == (1, 10)


class _Opaque:
    pass


def test_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match='missing_file.pth'):
        create_model('deit_s', img_size=32, pretrained=tmp_path / 'missing_file.pth')
    torch.save(create_model('vit_tiny').state_dict(), tmp_path / 'vit.pth')
    with pytest.raises(ValueError, match='do not fit'):
        create_model('deit_s', img_size=32, pretrained=tmp_path / 'vit.pth')
    partial = {k: v for k, v in create_model('vit_tiny').state_dict().items() if 'blocks.11' not in k}
    torch.save(partial, tmp_path / 'partial.pth')
    with pytest.raises(ValueError, match='missing'):
        create_model('vit_tiny', pretrained=tmp_path / 'partial.pth')
    torch.save({'x': _Opaque()}, tmp_path / 'obj.pth')  # an arbitrary object: refused by weights_only=True
    with pytest.raises(ValueError, match='weights_only'):
        read_state_dict(tmp_path / 'obj.pth')


def test_load_pretrained_into_resnet(tmp_path):
    source = _randomise_head(create_model('resnet18_gn', num_classes=100))
    torch.save(source.state_dict(), tmp_path / 'r.pth')
    model = load_pretrained(create_model('resnet18_gn', num_classes=10), tmp_path / 'r.pth')
    assert torch.equal(model.layer3[1].conv2.weight, source.layer3[1].conv2.weight)
    assert model.fc.weight.shape == (10, 512)


def test_pass_throughs_and_errors():
    m = create_model('timm:resnet18', num_classes=4)
    assert m.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 4) and find_head(m).out_features == 4
    t = create_model('torchvision:mobilenet_v3_small', num_classes=3, dropout=0.0)
    assert t.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    with pytest.raises(ValueError, match='resnet18_gn') as e: create_model('resnet50_gn')
    assert 'timm:<name>' in str(e.value)
    with pytest.raises(ValueError, match='timm.list_models'): create_model('timm:no_such_net')
    with pytest.raises(ValueError, match='torchvision.models.list_models'): create_model('torchvision:no_such_net')
    with pytest.raises(ValueError, match='never download'): create_model('timm:resnet18', pretrained=True)
    with pytest.raises(ValueError, match='never download'): create_model('torchvision:resnet18', weights='DEFAULT')
    with pytest.raises(ValueError, match='final linear'): create_model('torchvision:squeezenet1_0', num_classes=3)


def test_batchnorm_to_groupnorm_on_torchvision_resnet():
    torch.manual_seed(0)
    model = create_model('torchvision:resnet18', num_classes=5)
    for n, m in model.named_modules():
        if isinstance(m, nn.BatchNorm2d): nn.init.normal_(m.weight); nn.init.normal_(m.bias)  # not the defaults
    bns = {n: (m.num_features, m.weight.detach().clone(), m.bias.detach().clone())
           for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    x = torch.randn(4, 3, 32, 32)
    shape = model.eval()(x).shape
    out = batchnorm_to_groupnorm(model)
    assert out is model and _no_batchnorm(model) and len(bns) == 20
    mods = dict(model.named_modules())
    for name, (c, w, b) in bns.items():
        gn = mods[name]
        assert isinstance(gn, nn.GroupNorm) and gn.num_channels == c and gn.num_groups == 32
        assert torch.equal(gn.weight.detach(), w) and torch.equal(gn.bias.detach(), b)
    model.train()
    y = model(x)
    assert y.shape == shape
    assert torch.allclose(y[1:2], model(x[1:2]), atol=1e-4)  # independent rows in training mode


def test_batchnorm_to_groupnorm_group_rule_and_flat_inputs():
    assert [largest_divisor(c, 32) for c in (64, 96, 48, 7, 1)] == [32, 32, 24, 7, 1]
    net = nn.Sequential(nn.Linear(5, 20), nn.BatchNorm1d(20), nn.Linear(20, 3), nn.BatchNorm1d(3, affine=False),
                        nn.Conv1d(1, 12, 1), nn.BatchNorm1d(12))
    batchnorm_to_groupnorm(net, groups=32)
    assert (net[1].num_groups, net[3].num_groups, net[5].num_groups) == (10, 1, 6)  # >= 2 channels per group
    assert not net[3].affine
    h = net[:2](torch.randn(4, 5))
    assert h.shape == (4, 20) and h.std(dim=1).min() > 0.5  # flat features keep information
    assert isinstance(batchnorm_to_groupnorm(nn.BatchNorm2d(8)), nn.GroupNorm)
    gn = batchnorm_to_groupnorm(nn.BatchNorm2d(8).double())
    assert gn.weight.dtype == torch.float64 and gn(torch.randn(2, 8, 3, 3, dtype=torch.float64)).dtype == torch.float64
    with pytest.raises(ValueError, match='groups'): batchnorm_to_groupnorm(net, groups=0)
