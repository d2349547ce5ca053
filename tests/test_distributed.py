"""Four processes, two simulated nodes of two ranks, gloo backend, the public API end to end."""

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("drop_last", [False, True])
def test_two_nodes_two_ranks(photos_dataset, tmp_path, drop_last):
    out = str(tmp_path / "report.json")
    port = free_port()
    procs = []
    try:
        for node in range(2):
            for local in range(2):
                rank = node * 2 + local
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(local), GROUP_RANK=str(node),
                           LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           GDSDATA_CPU_THREADS="1", OMP_NUM_THREADS="1")
                procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "dist_worker.py"),
                                               photos_dataset[2], out, "7", "1" if drop_last else "0"], env=env))
        codes = [p.wait(timeout=240) for p in procs]
    finally:  # a rank left waiting (a failed or timed-out run) must not outlive the test
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0, 0, 0]
    with open(out) as f:
        reports = json.load(f)
    assert sorted((r["node"], r["local_rank"]) for r in reports) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({len(r["labels"]) for r in reports}) == 1  # the same number of batches everywhere
    seen = [i for r in reports for batch in r["planned"] for i in batch]
    size = 60
    if drop_last:
        assert len(seen) == len(set(seen)) and size - len(seen) < 4 * 7
    else:
        assert set(seen) == set(range(size)) and len(seen) - size < 4
    shares = [set(i for b in r["planned"] for i in b) for r in reports]
    if drop_last:
        assert all(not (a & b) for k, a in enumerate(shares) for b in shares[k + 1:])  # disjoint
    for r in reports:
        assert r["labels"] == r["targets"]  # what was yielded is what was planned
