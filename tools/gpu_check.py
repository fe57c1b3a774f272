"""Every CUDA path of capskip in one prepared command, for a session that is lent a GPU (a maintainers' helper).

Usage:
  python tools/gpu_check.py                      # on cuda: records into nbs/recorded/ (each step has its own time limit, 70 minutes in all; its time on a GPU is not measured yet)
  python tools/gpu_check.py --device cpu --quick --records /tmp/rec   # the same steps, small, on a CPU (CI runs this)

Steps, each a subprocess with its own time limit, in this order (the cheap, decisive ones first):
  1. exactness: `capskip check` (reuse and reforward against plain autograd) on resnet18_gn and vit_tiny at 64 px,
     and tests/test_autograd_native.py on the device (CAPSKIP_TEST_DEVICE): hooks, GradScaler, accumulation;
  2. `capskip bench selector`;
  3. `capskip bench step` for resnet18_gn and vit_tiny --img 64, eager and --compile (k = 0.35, 0.69);
  4. `capskip demo` on the device.
Each bench step and the demo writes its record (command, machine, date, load) to --records (default nbs/recorded/,
named *_<device>.json); the selector bench's table is saved there as bench_selector_<device>.txt. A summary line per step (ok / FAILED / timed out, seconds) is printed and written to
<records>/gpu_check_<device>.json; the exit status is 1 if any step failed.
"""
import argparse, json, os, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def steps(device: str, quick: bool, records: Path, demo_out: Path) -> list[tuple[str, list[str], dict, int]]:
    "(name, command, extra environment, time limit in seconds) for every step."
    cap = [sys.executable, '-m', 'capskip']
    tag = device.replace(':', '')
    small = ['--batch', '8', '--repeats', '1', '--warmup', '1', '--keep', '0.5'] if quick else ['--keep', '0.35,0.69']
    out = [('check resnet18_gn', cap + ['check', '--model', 'resnet18_gn', '--device', device], {}, 300),
           ('check vit_tiny 64 px', cap + ['check', '--model', 'vit_tiny', '--img', '64', '--device', device], {}, 300),
           ('autograd-native tests', [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                                      'tests/test_autograd_native.py'], {'CAPSKIP_TEST_DEVICE': device}, 300),
           ('bench selector', cap + ['bench', 'selector', '--device', device]
            + (['--batch', '128', '--dims', '384', '--repeats', '3', '--backend', 'none'] if quick else []), {}, 300)]
    for model, extra in (('resnet18_gn', []), ('vit_tiny', ['--img', '64'])):
        name = model + ('_64' if extra else '')
        for compiled in ((False,) if quick else (False, True)):
            rec = records / f'bench_step_{name}{"_compiled" if compiled else ""}_{tag}.json'
            cmd = cap + ['bench', 'step', '--model', model, *extra, '--device', device, *small, '--record', str(rec)]
            out.append((f'bench step {name}{" compiled" if compiled else ""}', cmd + (['--compile'] if compiled else []),
                        {}, 600))
    demo = cap + ['demo', '--set', f'device={device}', '--out', str(demo_out), '--record', str(records / f'demo_{tag}.json')]
    out.append(('demo', demo + (['--seeds', '1', '--epochs', '1'] if quick else []), {}, 600))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description='Run every CUDA path of capskip once and record the results.')
    p.add_argument('--device', default='cuda', help='cuda, cuda:i or cpu (default cuda)')
    p.add_argument('--quick', action='store_true', help='small sizes, no --compile and one demo seed: a smoke test')
    p.add_argument('--records', default=str(ROOT / 'nbs' / 'recorded'), help='folder for the records (default nbs/recorded)')
    p.add_argument('--only', default='', help='comma-separated step names to run (default: all)')
    ns = p.parse_args(argv)
    if ns.device.startswith('cuda'):
        import torch
        if not torch.cuda.is_available():
            print('gpu_check: no CUDA device is visible; run with --device cpu --quick to check the steps on a CPU',
                  file=sys.stderr)
            return 2
    records = Path(ns.records)
    records.mkdir(parents=True, exist_ok=True)
    demo_out = records / f'.gpu_check_demo_{ns.device.replace(":", "")}'
    wanted = {s.strip() for s in ns.only.split(',') if s.strip()}
    summary, failed = [], 0
    for name, cmd, env, limit in steps(ns.device, ns.quick, records, demo_out):
        if wanted and name not in wanted: continue
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **env), capture_output=True, text=True, timeout=limit)
            status = 'ok' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'
            tail = (proc.stdout + proc.stderr)[-1500:]
        except subprocess.TimeoutExpired:
            status, tail = f'timed out after {limit} s', ''
        seconds = time.perf_counter() - start
        if name == 'bench selector' and status == 'ok':
            (records / f'bench_selector_{ns.device.replace(":", "")}.txt').write_text(' '.join(cmd[1:]) + '\n' + proc.stdout)
        failed += status != 'ok'
        summary.append({'step': name, 'status': status, 'seconds': round(seconds, 1), 'command': ' '.join(cmd[1:])})
        print(f'{name:32s} {status:24s} {seconds:7.1f} s', flush=True)
        if status != 'ok': print(tail, flush=True)
    (records / f'gpu_check_{ns.device.replace(":", "")}.json').write_text(json.dumps(summary, indent=1) + '\n')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
