"""A CUDA stream that waits for a host thread: the device, not the engine thread, waits for a step's masks.

`HostGate.wait` queues a wait on a stream (the driver's cuStreamWaitValue32, through ctypes: torch has
no binding); the work queued after it starts once a host thread has `open`ed the gate for that ticket,
by writing the ticket into a pinned word the device reads. No kernel spins meanwhile: the stream's
front end waits, so the forward pass queued on another stream keeps every SM.

A ticket the host never opens stalls the stream for good: a caller opens every ticket it waits for,
from code that cannot skip it (the mask fill's thread, after the step's fills, whatever they raised).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

_WAIT_VALUE_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: until (int32)(*word - ticket) >= 0, wrap-around ignored


@functools.cache
def _driver() -> Optional[ctypes.CDLL]:
    """libcuda with the two calls typed, or None where it (or the calls) is missing."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        wait = driver.cuStreamWaitValue32_v2
        device_pointer = driver.cuMemHostGetDevicePointer_v2
    except (OSError, AttributeError):
        return None
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    wait.restype = ctypes.c_int
    device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    device_pointer.restype = ctypes.c_int
    return driver


class HostGate:
    def __init__(self, driver: ctypes.CDLL, word: torch.Tensor, address: int) -> None:
        self._wait = driver.cuStreamWaitValue32_v2
        self._word = word  # held: the device reads it
        self._value = word.numpy().view(np.uint32)
        self._address = address
        self._last = 0

    @classmethod
    def create(cls, device: torch.device) -> Optional[HostGate]:
        """A gate for `device`'s streams, or None where the driver cannot wait on a host word (the
        engine thread then waits for the masks itself)."""
        driver = _driver()
        if driver is None or device.type != "cuda":
            return None
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).synchronize()  # the context, current on this thread
            word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            address = ctypes.c_uint64()
            status = driver.cuMemHostGetDevicePointer_v2(ctypes.byref(address), ctypes.c_void_p(word.data_ptr()), 0)
            if status != 0:
                logger.info("the device cannot read pinned host memory (CUresult %d): the engine waits for masks", status)
                return None
            gate = cls(driver, word, address.value)
            try:  # an open ticket: returns at once where the driver takes the call
                gate.wait(torch.cuda.current_stream(device), 0)
                torch.cuda.current_stream(device).synchronize()
            except RuntimeError as error:
                logger.info("streams cannot wait on host memory here (%s): the engine waits for masks", error)
                return None
        return gate

    def ticket(self) -> int:
        """The next ticket: `wait` for it, and `open` it once."""
        self._last = (self._last + 1) & 0xFFFFFFFF
        return self._last

    def wait(self, stream: torch.cuda.Stream, ticket: int) -> None:
        """The work queued on `stream` after this starts once `ticket` (or a later one) is open."""
        status = self._wait(ctypes.c_void_p(stream.cuda_stream), self._address, ticket, _WAIT_VALUE_GEQ)
        if status != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {status})")

    def open(self, ticket: int) -> None:
        """Let the streams waiting for `ticket` (and earlier ones) go on. Tickets open in order."""
        self._value[0] = ticket


@dataclass(frozen=True)
class GateTicket:
    """One wait: what `upload` queues before it copies masks the fill may still be writing."""

    gate: HostGate
    ticket: int

    def wait(self, stream: torch.cuda.Stream) -> None:
        self.gate.wait(stream, self.ticket)
