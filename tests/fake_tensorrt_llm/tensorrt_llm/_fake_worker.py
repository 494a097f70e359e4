"""FAKE TensorRT-LLM worker process (NOT NVIDIA's code): the executor outside the serving process.

Started by the fake LLM as `python -m tensorrt_llm._fake_worker` in a fresh interpreter whose
only import paths are PYTHONPATH and the installed packages, as TensorRT-LLM's MPI workers are:
the requests' pickled SamplingParams (and the logits processors in them) are unpickled here,
so whatever they reference must be importable here. Messages are pickles on stdin/stdout.
"""

from __future__ import annotations

import pickle
import sys
import threading

from tensorrt_llm._fake_executor import ExecutorSpec, FakeExecutor


def main() -> None:
    commands, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the reply stream
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            pickle.dump(message, replies)
            replies.flush()

    spec, batched = pickle.load(commands)
    executor = FakeExecutor(ExecutorSpec(**spec), lambda request_id, response: send((request_id, response)),
                            pickle.loads(batched) if batched else None)
    send((None, ("ready",)))
    while True:
        try:
            message = pickle.load(commands)
        except EOFError:
            break
        kind = message[0]
        if kind == "submit":
            _, request_id, prompt, params = message
            try:  # the IPC hands the worker pickled requests
                executor.submit(request_id, prompt, pickle.loads(params))
            except Exception as error:
                send((request_id, ("error", f"{type(error).__name__}: {error}")))
        elif kind == "abort":
            executor.abort(message[1])
        elif kind == "pending":
            send((None, ("pending", executor.pending())))
        elif kind == "shutdown":
            break
    executor.shutdown()


if __name__ == "__main__":
    main()
