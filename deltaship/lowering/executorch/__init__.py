"""The ExecuTorch target's lowering: a stateful .pte for phones, XNNPACK-delegated, quantized with torchao.

`program.py` builds the program (`lower`, `prepare`, the XNNPACK checks, the LLM runner's metadata),
`modules.py` is the XNNPACK-friendly layer layout (an export pass), `lowering.py` the kernels the
canonical ops become, `quant.py` torchao quantization, `requirements.py` the kernel libraries an app
must link.
"""
