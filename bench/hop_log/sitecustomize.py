"""A hop log for a benchmark run (bench/hop_waves.py reads it): where a request's time goes between
processes, and what pauses each process. Not imported by the service.

Put this folder first on PYTHONPATH (or copy this file into the folder that is: on the device,
/tmp/site after bench/gpu_serve.sh's install) and set HOP_DIR for the server and the benchmark;
every Python process then writes HOP_DIR/<pid>.jsonl: its command line, garbage collections of
2 ms or more, event-loop lags of 15 ms or more (API workers), 8 ms wake-up lags of a 1-ms sleeper
thread (engine process: GIL or CPU starvation), each chat request's planning start and end and its
"add" sent (API workers), received and submitted (engine process), the mask fill's start after
`begin_ahead` (the wait for the draw included), its duration and the loop guard's steering, every
200 fills of 64 rows or more (engine process), and
each client job's common start (bench/http_load.py). Times are time.perf_counter: CLOCK_MONOTONIC,
one clock for all the processes of a machine. It patches our modules as they are imported, and the
1-ms sleeper and the fill timing cost the engine process some GIL time: compare runs that both
have it."""
import json
import os
import sys
import threading
import time

HOP_DIR = os.environ.get("HOP_DIR")
if HOP_DIR:
    os.makedirs(HOP_DIR, exist_ok=True)
    _file = open(os.path.join(HOP_DIR, f"{os.getpid()}.jsonl"), "a", buffering=1)
    _lock = threading.Lock()
    try:
        _cmd = open("/proc/self/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        _cmd = "?"

    def hop(kind, **fields):
        line = json.dumps({"t": time.perf_counter(), "k": kind, **fields})
        with _lock:
            _file.write(line + "\n")

    hop("start", cmd=_cmd)

    import gc
    _gc_started = {}
    _submitted = {}

    def _gc_cb(phase, info):
        if phase == "start":
            _gc_started["t"] = time.perf_counter()
        else:
            took = time.perf_counter() - _gc_started.get("t", time.perf_counter())
            if took >= 0.002:
                hop("gc", ms=round(took * 1e3, 2), gen=info.get("generation"), collected=info.get("collected"))

    gc.callbacks.append(_gc_cb)

    def _thread_lag_monitor(name):
        def run():
            while True:
                t0 = time.perf_counter()
                time.sleep(0.001)
                lag = time.perf_counter() - t0 - 0.001
                if lag > 0.008:
                    hop("thread_lag", ms=round(lag * 1e3, 2), where=name)
        threading.Thread(target=run, daemon=True, name="hop-lag").start()

    def _patch_core_client(module):
        cls = module.EngineCoreClient
        send, start = cls._send, cls.start

        def _send(self, message):
            if message and message[0] == "add":
                hop("add_sent", rid=message[1], grammar=message[4] is not None)
            return send(self, message)

        async def start_(self):
            import asyncio

            async def lag():
                while True:
                    t0 = time.perf_counter()
                    await asyncio.sleep(0.005)
                    late = time.perf_counter() - t0 - 0.005
                    if late > 0.015:
                        hop("loop_lag", ms=round(late * 1e3, 2))
            asyncio.get_running_loop().create_task(lag())
            return await start(self)

        cls._send, cls.start = _send, start_
    def _patch_torch_engine(module):
        cls = module.TorchEngine
        submit = cls.submit

        def submit_(self, request, route):
            hop("submit", rid=request.request_id, grammar=request.constraint is not None)
            return submit(self, request, route)

        cls.submit = submit_
        if "core_process" in _cmd:
            _thread_lag_monitor("engine-process")
    def _patch_postprocessor(module):
        cls = module.MaskPostProcessor
        fill = cls.fill
        stats = {"n": 0, "queued": [], "took": [], "steer": []}

        def fill_(self, rows, offset=0):
            t0 = time.perf_counter()
            submitted = _submitted.pop("t", None)
            try:
                return fill(self, rows, offset)
            finally:
                t1 = time.perf_counter()
                if len(rows) >= 64:
                    stats["n"] += 1
                    if submitted is not None:
                        stats["queued"].append(t0 - submitted)
                    stats["took"].append(t1 - t0)
                    if stats["n"] % 200 == 0:
                        def q(v, p):
                            v = sorted(v)
                            return round(v[int(p * (len(v) - 1))] * 1e3, 3) if v else None
                        hop("fill_stats", rows=len(rows), queued50=q(stats["queued"], .5), queued90=q(stats["queued"], .9),
                            took50=q(stats["took"], .5), took90=q(stats["took"], .9),
                            steer50=q(stats["steer"], .5), steer90=q(stats["steer"], .9))
                        stats.update(queued=[], took=[], steer=[])

        steer = module.steer_loops

        def steer_(rows, masks, steering, escapes):
            t = time.perf_counter()
            steer(rows, masks, steering, escapes)
            if len(rows) >= 64:
                stats["steer"].append(time.perf_counter() - t)

        cls.fill, module.steer_loops = fill_, steer_
    def _patch_constraint_stage(module):
        cls = module.ConstraintStage
        begin_ahead = cls.begin_ahead

        def begin_ahead_(self, running, tokens):
            _submitted["t"] = time.perf_counter()
            return begin_ahead(self, running, tokens)

        cls.begin_ahead = begin_ahead_
    def _patch_chat(module):
        plan_chat = module.plan_chat

        async def plan_chat_(request, runtime):
            hop("plan_start", grammar=getattr(request, "response_format", None) is not None)
            try:
                return await plan_chat(request, runtime)
            finally:
                hop("plan_end")

        module.plan_chat = plan_chat_
    def _patch_http_load(module):
        run_stream_job = module.run_stream_job

        def run_stream_job_(job):
            hop("client_job", start_at=job.start_at, n=len(job.bodies))
            return run_stream_job(job)

        run_stream_job_.__qualname__ = run_stream_job_.__name__ = "run_stream_job"
        run_stream_job_.__module__ = "http_load"
        module.run_stream_job = run_stream_job_

    # Each module patched as it is imported, by name.
    _PATCHES = {
        "llgtrt_core.engine.core_client": _patch_core_client,
        "llgtrt_core.engine.torch_engine": _patch_torch_engine,
        "llgtrt_core.constraints.postprocessor": _patch_postprocessor,
        "llgtrt_core.engine.constraint_stage": _patch_constraint_stage,
        "llgtrt_core.api.chat": _patch_chat,
        "http_load": _patch_http_load,
    }

    if "core_process" in _cmd:  # when each "add" leaves the socket in the engine process
        import multiprocessing.connection as _mpc
        _recv = _mpc.Connection.recv

        def _recv_(self):
            message = _recv(self)
            if isinstance(message, tuple) and message and message[0] == "add":
                hop("add_recv", rid=message[1], grammar=message[4] is not None)
            return message

        _mpc.Connection.recv = _recv_

    import importlib.abc

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in _PATCHES:
                return None
            for finder in sys.meta_path:
                if finder is self:
                    continue
                spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
                if spec is not None and spec.loader is not None:
                    exec_module = spec.loader.exec_module

                    def exec_and_patch(mod, _exec=exec_module, _patch=_PATCHES[fullname]):
                        _exec(mod)
                        _patch(mod)
                    spec.loader.exec_module = exec_and_patch
                    return spec
            return None

    sys.meta_path.insert(0, _Finder())
