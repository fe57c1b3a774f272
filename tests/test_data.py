"""capskip.runs.data: seeded stratified splits, (x, y, idx) rows, plan loaders, and CIFAR-100 read from real-format files."""
import pickle
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader

from capskip.runs.data import (CIFAR100_MEAN, CIFAR100_STD, IMAGENET_MEAN, IMAGENET_STD, CIFAR100Files, ImageRows,
                               ImageTransform, Splits, cifar100_splits, create_splits, digits_splits, list_splits,
                               make_loader, stratified_split, synthetic_splits)
from capskip.testing.files import write_fake_cifar100


# ---------------------------------------------------------------- stratified_split
@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 30), min_size=1, max_size=8), fracs=st.tuples(st.floats(0.0, 0.5), st.floats(0.0, 0.5)),
       seed=st.integers(0, 9))
def test_stratified_split_is_an_exact_proportional_partition(counts, fracs, seed):
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
    labels = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))]
    sizes = [int(f * len(labels)) for f in fracs]
    *parts, rest = stratified_split(labels, sizes, seed=seed)
    assert [len(p) for p in parts] == sizes and len(rest) == len(labels) - sum(sizes)
    assert torch.equal(torch.cat([*parts, rest]).sort().values, torch.arange(len(labels)))
    ideal_share = torch.tensor(counts, dtype=torch.float64) / len(labels)
    for part, size in zip(parts, sizes):
        got = torch.bincount(labels[part], minlength=len(counts)).double()
        assert (got - ideal_share * size).abs().max() < 1.0 + 1e-9  # each class within one row of its share


def test_stratified_split_is_seeded():
    labels = torch.arange(500) % 7
    a = stratified_split(labels, [50, 100], seed=5)
    b = stratified_split(labels, [50, 100], seed=5)
    c = stratified_split(labels, [50, 100], seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_stratified_split_rejects_oversized_request():
    with pytest.raises(ValueError, match='sum to at most'):
        stratified_split(torch.zeros(10), [6, 5])


# ---------------------------------------------------------------- digits
def test_digits_split_sizes_shapes_and_normalisation():
    from sklearn.datasets import load_digits
    s = digits_splits(img_size=16, seed=0)
    assert isinstance(s, Splits) and (s.num_classes, s.in_chans, s.img_size) == (10, 1, 16)
    assert [len(s.train), len(s.val), len(s.test)] == [1257, 180, 360]
    x, y, i = s.train[3]
    assert x.shape == (1, 16, 16) and x.dtype == torch.float32 and i.item() == 3 and y.item() == s.train.labels[3]
    assert abs(s.train.images.mean().item()) < 1e-4 and abs(s.train.images.std().item() - 1) < 1e-3
    # the three splits together hold every digit exactly once (label counts match the source)
    labels = torch.cat([s.train.labels, s.val.labels, s.test.labels])
    assert Counter(labels.tolist()) == Counter(load_digits().target.tolist())
    for part, n in ((s.val, 180), (s.test, 360)):  # stratified
        got = torch.bincount(part.labels, minlength=10).double()
        ideal = torch.bincount(torch.as_tensor(load_digits().target), minlength=10).double() * n / 1797
        assert (got - ideal).abs().max() < 1.0


def test_digits_upscale_is_bilinear_of_the_source():
    from sklearn.datasets import load_digits
    s8, s24 = digits_splits(img_size=8, seed=2), digits_splits(img_size=24, seed=2)
    assert torch.equal(s8.test.labels, s24.test.labels)
    # undo s8's normalisation via its raw pixels: the 24-px image is the bilinear upscale of the 8-px one (up to affine)
    small = s8.test.images[:5]
    up = F.interpolate(small, size=(24, 24), mode='bilinear', align_corners=False)
    big = s24.test.images[:5]
    a = torch.linalg.lstsq(torch.stack([up.flatten(), torch.ones(up.numel())], 1), big.flatten()[:, None]).solution
    fit = a[0] * up.flatten() + a[1]
    assert torch.allclose(fit, big.flatten(), atol=1e-4)
    pixels = torch.as_tensor(load_digits().data, dtype=torch.float32)
    assert any(torch.allclose((pixels[k] - pixels[k].mean()) / pixels[k].std(),
                              (small[0].flatten() - small[0].mean()) / small[0].std(), atol=1e-5) for k in range(1797))


def test_digits_seed_determinism_and_difference():
    a, b, c = digits_splits(seed=0), digits_splits(seed=0), digits_splits(seed=1)
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.val.labels, b.val.labels)
    assert not torch.equal(a.test.images, c.test.images)


def test_digits_three_channels_and_bad_args():
    s = digits_splits(img_size=12, in_chans=3)
    x = s.train[0][0]
    assert x.shape == (3, 12, 12) and torch.equal(x[0], x[2])
    with pytest.raises(ValueError, match='img_size'): digits_splits(img_size=4)
    with pytest.raises(ValueError, match='in_chans'): digits_splits(in_chans=2)


# ---------------------------------------------------------------- loaders
def test_make_loader_serves_the_plan_in_order():
    s = digits_splits(img_size=8)
    plan = [torch.tensor([5, 0, 9]), torch.tensor([1]), torch.tensor([1256, 2])]
    got = list(make_loader(s.train, plan))
    assert len(got) == 3
    for (x, y, idx), rows in zip(got, plan):
        assert torch.equal(idx, rows) and torch.equal(y, s.train.labels[rows]) and torch.equal(x, s.train.images[rows])
    with pytest.raises(ValueError, match='outside'): make_loader(s.train, [torch.tensor([1257])])
    with pytest.raises(TypeError, match='integer'): make_loader(s.train, [torch.tensor([], dtype=torch.long)])


@pytest.fixture(scope='module')
def cifar_root(tmp_path_factory):
    root = tmp_path_factory.mktemp('cifar')
    write_fake_cifar100(root, per_class_train=10, per_class_test=2, seed=0)
    return root


def test_augmented_loader_is_independent_of_workers(cifar_root):
    s = cifar100_splits(cifar_root, seed=3)
    plan = [torch.tensor([4, 8, 15]), torch.tensor([16, 23, 42])]
    s.train.set_epoch(2)
    serial = list(make_loader(s.train, plan, num_workers=0))
    parallel = list(make_loader(s.train, plan, num_workers=2))
    for (x0, y0, i0), (x1, y1, i1) in zip(serial, parallel):
        assert torch.equal(x0, x1) and torch.equal(y0, y1) and torch.equal(i0, i1)
        assert x0.shape == (3, 3, 32, 32)
    s.train.set_epoch(3)
    assert not torch.equal(list(make_loader(s.train, plan))[0][0], serial[0][0])


def test_batched_fetch_equals_items_and_plain_dataloader_works(cifar_root):
    s = cifar100_splits(cifar_root, seed=1)
    s.train.set_epoch(4)
    rows = torch.tensor([7, 3, 99, 3])
    x, y, idx = s.train.fetch(rows)
    for k, r in enumerate(rows.tolist()):
        xi, yi, ii = s.train[r]
        assert torch.equal(x[k], xi) and y[k] == yi and ii == r
    # a user's own DataLoader with the default collate also gets (x, y, idx) batches
    x2, y2, idx2 = next(iter(DataLoader(s.train, batch_size=4, shuffle=False)))
    assert torch.equal(idx2, torch.arange(4)) and torch.equal(x2, s.train.fetch(torch.arange(4))[0])


# ---------------------------------------------------------------- CIFAR-100 real-format round trip
class _Py2Pickler(pickle._Pickler):
    """Writes pickles the way Python 2's cPickle wrote the official CIFAR-100 files: byte strings as (SHORT_)BINSTRING
    and NumPy globals under `numpy.core` (the files predate NumPy 2)."""
    dispatch = pickle._Pickler.dispatch.copy()

    def save_binstring(self, data):
        if len(data) < 256: self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else: self.write(pickle.BINSTRING + struct.pack('<i', len(data)) + data)
        self.memoize(data)

    def save_text(self, text): self.save_binstring(text.encode('latin1'))

    def save_global(self, obj, name=None):
        module = obj.__module__.replace('numpy._core', 'numpy.core')
        self.write(pickle.GLOBAL + module.encode() + b'\n' + (name or obj.__qualname__).encode() + b'\n')
        self.memoize(obj)


_Py2Pickler.dispatch[bytes] = _Py2Pickler.save_binstring
_Py2Pickler.dispatch[str] = _Py2Pickler.save_text


def test_cifar_python2_pickles_load(tmp_path):
    folder = write_fake_cifar100(tmp_path, per_class_train=5, per_class_test=1, seed=4)
    originals = {name: _read(folder / name) for name in ('train', 'test', 'meta')}
    for name, entry in originals.items():
        with open(folder / name, 'wb') as f: _Py2Pickler(f, protocol=2).dump(entry)
    assert b'numpy.core.multiarray' in (folder / 'train').read_bytes()
    s = cifar100_splits(tmp_path, seed=0)
    assert [len(s.train), len(s.val), len(s.test)] == [450, 50, 100]
    assert torch.equal(s.test.images.reshape(100, 3072), torch.from_numpy(originals['test']['data']))
    assert s.classes == originals['meta']['fine_label_names']


def test_cifar_download_passes_through_to_torchvision(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as tv_cifar
    calls = []

    def fake_download(url, download_root, filename=None, md5=None, **kw):
        calls.append((url, md5))
        write_fake_cifar100(download_root, per_class_train=2, per_class_test=1)

    monkeypatch.setattr(tv_cifar, 'download_and_extract_archive', fake_download)
    s = cifar100_splits(tmp_path, download=True)
    assert calls and calls[0][0].endswith('cifar-100-python.tar.gz') and calls[0][1]  # the official archive, md5-checked
    assert len(s.train) + len(s.val) == 200


def _read(path):
    with open(path, 'rb') as f: return pickle.load(f, encoding='latin1')


@pytest.mark.parametrize('protocol', [2, 4])
def test_cifar_round_trip(tmp_path, protocol):
    write_fake_cifar100(tmp_path, per_class_train=10, per_class_test=3, seed=1, protocol=protocol)
    train_raw, test_raw = _read(tmp_path / 'cifar-100-python/train'), _read(tmp_path / 'cifar-100-python/test')
    s = cifar100_splits(tmp_path, img_size=32, augment=False, seed=0)
    assert (s.num_classes, s.in_chans) == (100, 3)
    assert [len(s.train), len(s.val), len(s.test)] == [900, 100, 300]
    assert torch.equal(torch.bincount(s.val.labels, minlength=100), torch.ones(100, dtype=torch.long))
    assert s.classes == _read(tmp_path / 'cifar-100-python/meta')['fine_label_names']
    # test rows: the official channel-major [N, 3072] rows decoded in file order
    assert torch.equal(s.test.images.reshape(300, 3072), torch.from_numpy(test_raw['data']))
    assert s.test.labels.tolist() == test_raw['fine_labels']
    # train + val together are exactly the training file's rows
    rows = torch.cat([s.train.images, s.val.images]).reshape(1000, 3072)
    assert sorted(map(bytes, rows.numpy())) == sorted(map(bytes, train_raw['data']))
    # no augmentation: x is the normalised pixel tensor
    x, y, i = s.train[11]
    mean, std = torch.tensor(CIFAR100_MEAN).view(3, 1, 1), torch.tensor(CIFAR100_STD).view(3, 1, 1)
    assert torch.allclose(x, (s.train.images[11].float() / 255 - mean) / std, atol=1e-6)
    assert (y.item(), i.item()) == (s.train.labels[11].item(), 11)


def test_cifar_split_seeded(cifar_root):
    a, b, c = (cifar100_splits(cifar_root, seed=k) for k in (0, 0, 1))
    assert torch.equal(a.val.images, b.val.images) and torch.equal(a.train.labels, b.train.labels)
    assert not torch.equal(a.val.images, c.val.images)


def test_cifar_from_scratch_augmentation(cifar_root):
    s = cifar100_splits(cifar_root, img_size=32, augment=True, seed=0)
    base = (s.train.images[0].float() / 255 - torch.tensor(CIFAR100_MEAN).view(3, 1, 1)) / torch.tensor(CIFAR100_STD).view(3, 1, 1)
    padded = F.pad(s.train.images[0].float() / 255, (4, 4, 4, 4))
    views = set()
    for epoch in range(12):
        s.train.set_epoch(epoch)
        x = s.train[0][0]
        assert torch.equal(x, s.train[0][0])  # deterministic per (seed, epoch, row)
        raw = x * torch.tensor(CIFAR100_STD).view(3, 1, 1) + torch.tensor(CIFAR100_MEAN).view(3, 1, 1)
        match = [(dy, dx, fl) for dy in range(9) for dx in range(9) for fl in (0, 1)
                 if torch.allclose(raw, (lambda c: c.flip(-1) if fl else c)(padded[:, dy:dy + 32, dx:dx + 32]), atol=1e-5)]
        assert match, 'augmented image is not a padded crop (+flip) of the original'
        views.add(match[0])
    assert len(views) > 3 and any(fl for _, _, fl in views)
    assert torch.allclose(s.val[0][0], (s.val.images[0].float() / 255 - torch.tensor(CIFAR100_MEAN).view(3, 1, 1))
                          / torch.tensor(CIFAR100_STD).view(3, 1, 1), atol=1e-6)


def test_cifar_finetune_resize_and_imagenet_stats(cifar_root):
    s = cifar100_splits(cifar_root, img_size=224, augment=True, seed=0)
    x = s.test[0][0]
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    ref = F.interpolate(s.test.images[:1].float() / 255, size=(224, 224), mode='bilinear', align_corners=False)[0]
    assert x.shape == (3, 224, 224) and torch.allclose(x, (ref - mean) / std, atol=1e-5)
    assert s.train[0][0].shape == (3, 224, 224)


def test_cifar_missing_root_names_path_and_remedy(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        cifar100_splits(tmp_path / 'nowhere')
    assert str(tmp_path / 'nowhere') in str(e.value) and '--download' in str(e.value)
    write_fake_cifar100(tmp_path)
    (tmp_path / 'cifar-100-python/test').unlink()
    with pytest.raises(FileNotFoundError, match='cifar-100-python/test'):
        cifar100_splits(tmp_path)


@pytest.mark.parametrize('damage', ['truncate', 'garbage', 'float_data', 'bad_labels', 'short_meta', 'not_a_dict'])
def test_cifar_corrupt_files_are_rejected(tmp_path, damage):
    folder = write_fake_cifar100(tmp_path, per_class_train=2, per_class_test=1)
    train = folder / 'train'
    if damage == 'truncate': train.write_bytes(train.read_bytes()[:5000])
    elif damage == 'garbage': train.write_bytes(b'\x00not a pickle' * 100)
    else:
        entry = _read(train)
        if damage == 'float_data': entry['data'] = entry['data'].astype(np.float32)
        if damage == 'bad_labels': entry['fine_labels'][0] = 100
        if damage == 'not_a_dict': entry = [1, 2, 3]
        if damage == 'short_meta':
            with open(folder / 'meta', 'wb') as f: pickle.dump({'fine_label_names': ['a'] * 10}, f, protocol=2)
        else:
            with open(train, 'wb') as f: pickle.dump(entry, f, protocol=2)
    with pytest.raises(ValueError) as e:
        cifar100_splits(tmp_path)
    assert 'cifar-100-python' in str(e.value) and 'download' in str(e.value)


class _Boom:
    def __reduce__(self):
        import os
        return (os.system, ('touch PWNED',))


def test_cifar_pickle_cannot_run_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = write_fake_cifar100(tmp_path, per_class_train=1, per_class_test=1)
    entry = _read(folder / 'train'); entry['batch_label'] = _Boom()
    with open(folder / 'train', 'wb') as f: pickle.dump(entry, f)
    with pytest.raises(ValueError, match='refusing'):
        cifar100_splits(tmp_path)
    assert not (tmp_path / 'PWNED').exists()


def test_cifar_files_subclass_matches_torchvision_fields(cifar_root):
    files = CIFAR100Files(cifar_root, train=True)
    assert files.data.shape == (1000, 32, 32, 3) and files.data.dtype == np.uint8 and len(files.targets) == 1000
    img, target = files[0]  # torchvision's __getitem__ still works (PIL image, int label)
    assert img.size == (32, 32) and target == files.targets[0]


# ---------------------------------------------------------------- synthetic and by name
def test_synthetic_splits_shapes_seeds():
    a = synthetic_splits(50, 12, 4, in_chans=3, seed=0, n_val=7, n_test=9)
    assert [len(a.train), len(a.val), len(a.test)] == [50, 7, 9]
    assert a.train[0][0].shape == (3, 12, 12) and int(a.train.labels.max()) < 4
    assert torch.equal(a.train.images, synthetic_splits(50, 12, 4, seed=0, n_val=7, n_test=9).train.images)
    assert not torch.equal(a.train.images, synthetic_splits(50, 12, 4, seed=1, n_val=7, n_test=9).train.images)
    with pytest.raises(ValueError, match='positive'): synthetic_splits(0, 8, 2)


def test_create_splits_by_name(cifar_root):
    assert len(create_splits('digits', img_size=8).test) == 360
    assert create_splits('synthetic', n=10, img_size=4, num_classes=2).num_classes == 2
    assert len(create_splits('cifar100', root=cifar_root).val) == 100
    with pytest.raises(ValueError, match='cifar100'): create_splits('mnist')
    import capskip.runs.text  # noqa: F401  (registers the text data set)
    image_and_digits = [n for n in list_splits() if not n.startswith('stdlib_')]   # capskip.runs.corpus adds stdlib_* when imported
    assert image_and_digits == ['digits', 'cifar100', 'synthetic', 'digits_text'] and list_splits('c*') == ['cifar100']
    assert list_splits('digits*') == ['digits', 'digits_text']


def test_image_rows_validates_inputs():
    with pytest.raises(ValueError, match=r'\[N, C, H, W\]'): ImageRows(torch.zeros(3, 4, 4), torch.zeros(3))
    with pytest.raises(ValueError, match='labels'): ImageRows(torch.zeros(3, 1, 4, 4), torch.zeros(2))
    with pytest.raises(IndexError): ImageRows(torch.zeros(3, 1, 4, 4), torch.zeros(3))[3]
    t = ImageTransform(size=4, mean=(0.,), std=(1.,))
    assert torch.equal(t(torch.full((2, 1, 4, 4), 255, dtype=torch.uint8)), torch.ones(2, 1, 4, 4))
    with pytest.raises(ValueError, match='generators'): ImageTransform(4, (0.,), (1.,), flip=True)(torch.zeros(2, 1, 4, 4), [torch.Generator()])


def test_importing_the_run_modules_does_not_import_torchvision():
    "torchvision loads torch._dynamo (~2 s a process): `CIFAR100Files` subclasses it on first access only (PEP 562)."
    import subprocess, sys
    code = ('import sys, capskip.runs.train, capskip.testing; before = "torchvision" in sys.modules; '
            'import capskip.runs.data as d; d.CIFAR100Files; print(before, "torchvision" in sys.modules)')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ['False', 'True'], out          # the control: asking for the class does import it
