"""A request to an engine model and the callback its responses reach, whichever transport carries them
(disagg.triton.transport)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from disagg.triton.contract import OUTPUTS_READ


@dataclass(frozen=True)
class EngineRequest:
    """One request to an engine model. `id`: Triton's request id, which a `stop` names."""
    model: str
    id: str
    inputs: dict[str, np.ndarray]
    parameters: dict[str, str]
    outputs: tuple[str, ...] = OUTPUTS_READ  # what gRPC asks for (HTTP's generate returns every output)


# on_response(result, error, final): result (`as_numpy(name)`, None for an output it lacks) is None exactly
# when error (a message, an EngineGone when the server went away) is set; an error is final.
OnResponse = Callable[[object, "str | None", bool], None]


class EngineGone(str):
    """An error meaning the engine server went away (its stream or connection broke): the request may be
    tried again once it is back, unlike an error the engine answered."""
