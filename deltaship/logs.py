"""Keep third-party chatter (CUDA kernel probes, version and deprecation warnings, install advice, C++ runtime
notices, progress bars) off the user's terminal unless they ask for it with `deltaship --verbose`.

Python loggers and warnings are silenced at their source. What native code writes to file descriptor 2 (ExecuTorch's
cpuinfo probe, ONNX Runtime before its own log level applies) no Python setting reaches: `native_stderr()` catches it
around the call and shows it only with --verbose, or when the call fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings
from typing import Iterator

VERBOSE_ENV = "DELTASHIP_VERBOSE"  # set by `deltaship --verbose`; read by child processes too (ORT worker, runners)
NOISY = ("torchao", "torch.utils._pytree", "transformers", "coremltools", "executorch", "torch._export")
# Loggers whose notices `import deltaship` already mutes (torch/transformers print them on import, before any
# deltaship call): torchao's "Failed to load ..._C_mxfp8...so" and torch's pytree Enum deprecation.
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def set_verbose(on: bool) -> None:
    if on:
        os.environ[VERBOSE_ENV] = "1"
    else:
        os.environ.pop(VERBOSE_ENV, None)


def ort_log_severity() -> int:
    """ONNX Runtime's SessionOptions.log_severity_level: errors only (3), everything with --verbose (0)."""
    return 0 if verbose() else 3


def quiet_import_notices() -> None:
    """Mute IMPORT_NOISE, unless the application has set those loggers' levels itself."""
    if verbose():
        return
    for name in IMPORT_NOISE:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.ERROR)


def quiet_third_party() -> None:
    """For the CLI and the toolchains deltaship drives: notices the user cannot act on stay out (--verbose: all in)."""
    if verbose():
        return
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.ERROR)
    # transformers sets its own level when it first configures its logger: tell it through its variable too.
    # (Its advice to install causal_conv1d / flash-linear-attention is about CUDA kernels, wrong on CPU.)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging  # lazy: transformers

        hf_logging.set_verbosity_error()
    os.environ.setdefault("TQDM_DISABLE", "1")  # coremltools' pass-pipeline progress bars
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", message=".*has not been tested with coremltools.*")
    warnings.filterwarnings("ignore", message=".*This API is experimental.*")  # ExecuTorch's pybindings
    for module in ("coremltools", "executorch", "torchao", "torch.utils._pytree", "torch.export", "copyreg"):
        warnings.filterwarnings("ignore", module=module)  # version and deprecation notices the user cannot act on


@contextlib.contextmanager
def native_stderr() -> Iterator[None]:
    """Catch what native code writes to stderr (file descriptor 2) inside the block, e.g. ExecuTorch's cpuinfo
    ("Failed to open midr file", "CPU info and manual query on # of cpus dont match"). It is shown afterwards
    with --verbose, or when the block raises (it may explain why); otherwise dropped."""
    if verbose():
        yield
        return
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (a notebook, a captured stream)
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    failed = False
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), fd)
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            if failed:
                sink.seek(0)
                caught = sink.read().decode(errors="replace")
                if caught.strip():
                    sys.stderr.write(caught)
                    sys.stderr.flush()
