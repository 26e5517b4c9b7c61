"""A final prompt that does not fit the model is refused with the ``k`` that would have fitted.

Whether ``k`` passages fit depends on which passages the search finds: their lengths vary, and so
``k``'s bound (``k_max``) cannot promise a fit. Cutting documents to fit would answer from other
text than the retrieval found, silently; so the query is refused (HTTP 400) and the message names
the largest ``k`` whose prompt, built from the same ranked passages, fits with the answer's
``max_tokens``: the caller asks again with it, or with a smaller ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable

from specrag.errors import InvalidInputError
from specrag.pipeline.engines.base import check_prompt_fits, prompt_fits
from specrag.pipeline.engines.protocol import Sampling

__all__ = ["check_final_prompt_fits"]


def check_final_prompt_fits(
    prompt_tokens: int,
    documents: int,
    prompt_tokens_with: Callable[[int], int],
    sampling: Sampling,
    max_model_len: int,
) -> None:
    """:func:`check_prompt_fits` for a prompt of ``documents`` passages; refused, the message names
    the largest number of them that fits (``prompt_tokens_with(j)``: the prompt's length with the
    first ``j`` passages of the ranking), or says that not even one does."""
    try:
        check_prompt_fits(prompt_tokens, sampling, max_model_len)
    except InvalidInputError as error:
        if prompt_tokens == 0 or documents < 1:
            raise
        fitting = next(
            (
                count
                for count in range(documents - 1, 0, -1)
                if prompt_fits(prompt_tokens_with(count), sampling, max_model_len)
            ),
            0,
        )
        advice = (
            f"with these passages the largest k that fits is {fitting}: ask with k={fitting}"
            if fitting
            else "not even one passage fits: shorten the question or lower max_tokens"
        )
        raise InvalidInputError(f"{error}; {advice}") from None
