"""`capskip bench step --ddp 2` (capskip.bench.ddp): two real gloo processes time dense, reforward and reuse under
torch's DistributedDataParallel and report ratios to the DDP dense step and the hidden share of the all-reduce."""
import math

from capskip.bench.ddp import DDPBench, format_ddp_table, run_ddp_bench


def test_two_processes_time_every_mode_against_ddp_dense():
    bench = DDPBench(model='digits_cnn', batch=16, keeps=(0.5,), repeats=1, img=16, num_classes=10)
    rows = run_ddp_bench(bench)
    assert [(r['mode'], r['k']) for r in rows] == [('dense', 1.0), ('reforward', 0.5), ('reuse', 0.5)]
    assert rows[0]['step_ratio'] == 1.0
    for r in rows:
        assert r['backward_ms'] > 0 and r['backward_local_ms'] > 0 and r['allreduce_ms'] > 0
        assert 0.0 <= r['overlap'] <= 1.0 and math.isfinite(r['step_ratio'])
        assert 0.0 <= r['left_at_first_bucket'] <= 1.0          # measured by the comm hook (tests/test_ddp_autograd.py: its values)
    table = format_ddp_table(rows, bench)
    assert '2 processes' in table and '| reuse | 0.5 |' in table and 'gradient left at 1st bucket' in table
