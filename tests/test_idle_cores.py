"""IdleCores: extra engine threads only while the machine's cores idle (compiled_decode.py's
prompt steps). /proc/stat is written here, as the kernel formats it; the sampler reads it."""

from __future__ import annotations

import time
from pathlib import Path

from llgtrt_core.engine.idle_cores import IdleCores, read_cpu_jiffies

WINDOW_S = 0.05
SAMPLED_S = 4 * WINDOW_S  # a few samples taken since the file changed
PATIENCE_S = 5.0  # a loaded machine may hold the sampler's thread back for a while


def settles(cores: IdleCores, expected: bool) -> bool:
    """Whether spare(1) reaches `expected` within PATIENCE_S (each call's expectation differs from
    the one before, so an unchanged answer fails)."""
    deadline = time.monotonic() + PATIENCE_S
    while cores.spare(1) != expected and time.monotonic() < deadline:
        time.sleep(WINDOW_S / 2)
    return cores.spare(1) == expected


def write_stat(path: Path, idle: int, busy: int) -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    path.write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")


def test_reads_the_kernels_format(tmp_path: Path) -> None:
    write_stat(tmp_path / "stat", idle=300, busy=100)
    assert read_cpu_jiffies(str(tmp_path / "stat")) == (300, 400)
    assert read_cpu_jiffies(str(tmp_path / "missing")) is None


def test_the_last_windows_idle_share_decides(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    write_stat(stat, idle=1000, busy=1000)
    cores = IdleCores(2, window_s=WINDOW_S, stat_path=str(stat))
    assert not cores.spare(1)  # nothing measured yet
    cores.start()  # this process sleeps: the busy ticks are other processes'
    write_stat(stat, idle=1190, busy=1010)  # of 200 ticks on 2 cores, 10 busy: 0.1 core
    assert settles(cores, True)
    write_stat(stat, idle=1390, busy=1210)  # of 400 ticks since, 200 busy: another process holds a core
    assert settles(cores, False)
    write_stat(stat, idle=1540, busy=1260)  # 0.5 core busy: one stream's own API process and client
    assert settles(cores, True)
    assert not cores.spare(2)


def test_without_proc_never_spare(tmp_path: Path) -> None:
    cores = IdleCores(2, window_s=WINDOW_S, stat_path=str(tmp_path / "missing"))
    cores.start()
    time.sleep(SAMPLED_S)
    assert not cores.spare(1)
