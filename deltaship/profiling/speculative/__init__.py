"""`deltaship profile BUNDLE --speculative mtp[:K]`: what speculative decoding with the bundle's MTP head costs
and gives, measured in one fresh process (deltaship/runtimes/speculative.py is the driver it measures).

Costs, at one context depth (`--contexts`' first, default 128), each timed like every profile phase (warmups, then
at least --reps samples and --min-seconds): one plain decode step; the verify call of T = 1 .. K+2 tokens (every
row's logits and hidden state: K+1 is the usual call, the pending token plus K drafts, longer ones follow a
rejection); the draft head over P = 1 .. K+1 new positions; the DeltaNet snapshot and its restore.

Generation, over a fixed prompt set (8 windows of the trained tiny preset's held-out text, through the bundle's
tokenizer, or as byte values when it has none): greedy decode tokens/s without and with speculation, one sample per
prompt each, both timed from the first new token to the last (prefill left out), in the same process; the
acceptance rate and the accepted length of the speculative runs; whether their tokens equal the plain ones.

Projection: decode tokens/s that the measured costs give at a stated acceptance rate (each draft accepted with
that probability, independently), simulating the driver's calls (snapshot every verify call, a restore and a longer
next call after a rejection). It is labelled a projection and cites where the rate comes from. On a bundle with
random weights (a published-shape preset) the measured acceptance means nothing, and the record says so.

Runtimes: deltaship's own session of the bundle (ONNX Runtime, ExecuTorch, Core ML). On Linux a Core ML bundle runs
in the MIL evaluator (the saved program op by op with numpy): the same measurements, but the record's `latencies`
says they are the evaluator's, not a device's (`device_latencies` false); tokens, acceptance and equality hold.
"""
