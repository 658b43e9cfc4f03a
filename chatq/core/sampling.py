"""What sampling means on both sides: the API's validation of a request and the worker's sampler. No dependencies, so
the engine runs where only torch is installed."""

from __future__ import annotations

# Below it, sampling takes the most likely token: the API refuses n > 1 there, and the worker's sampler picks the
# argmax rather than divide by a temperature near zero.
GREEDY_BELOW = 1e-5
