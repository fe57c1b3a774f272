"""The README's "Measured here" bench rows, printed from the recorded runs (a maintainers' helper).

Usage: python tools/bench_rows.py [NAME ...]   (NAME: the part of nbs/recorded/bench_step_NAME.json; default: every record)

Paste the rows into the table in nbs/index.ipynb, then run `capskip readme`. Columns: masked, re-forward (its ideal), reuse,
(1+2k)/3, reuse overhead, reuse backward / kept-only floor (median of per-repetition ratios; ratio of medians in
records made before the bench paired them), floor / dense backward, gathered bytes with their copy time at
the measured bandwidth and the gathers timed alone, reuse peak memory / dense.
"""
import json, sys
from pathlib import Path

from capskip.bench.step import backward_floor

RECORDED = Path(__file__).resolve().parents[1] / 'nbs' / 'recorded'
NAMES = {'resnet18_gn': 'ResNet-18-GN 32 px', 'timm_convnext_atto': 'ConvNeXt-atto (timm) 32 px', 'vit_tiny_32': 'ViT-tiny 32 px',
         'vit_tiny_64': 'ViT-tiny 64 px', 'vit_tiny_64_compiled': 'ViT-tiny 64 px compiled'}


def rows(name: str) -> list[str]:
    rec = json.loads((RECORDED / f'bench_step_{name}.json').read_text())
    by = {(r['mode'], r['keep']): r for r in rec['rows']}
    floor, out = {f['k']: f for f in backward_floor(rec['rows'])}, []
    for k in rec['bench']['keeps']:
        m, rf, ru, fl = by[('masked', k)], by[('reforward', k)], by[('reuse', k)], floor[k]
        alone = f"{ru['gather_alone_ms']:.1f} ms" if ru.get('gather_alone_ms') is not None else '–'
        out.append(f"| {NAMES.get(name, name)} | {k} | {m['ratio']:.3f} | {rf['ratio']:.3f} ({rf['ideal']:.3f}) | **{ru['ratio']:.3f}** | "
                   f"{ru['ideal']:.3f} | {ru['overhead']:+.3f} | {fl['reuse_over_floor']:.3f}× | "
                   f"{fl['floor_share']:.3f} | {ru['gathered_mib']:.0f} MiB, {ru['gather_copy_ms']:.1f} ms; {alone} | "
                   f"{ru['peak_mem']:.2f}× |")
    return out


if __name__ == '__main__':
    names = sys.argv[1:] or [p.stem.removeprefix('bench_step_') for p in sorted(RECORDED.glob('bench_step_*.json'))]
    print('\n'.join(line for n in names for line in rows(n)))
