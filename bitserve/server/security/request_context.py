"""What handlers ask of security about their own request: its principal, and token charges for a
generation (taken at admission, settled when it ends). Imports nothing from the routes."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request

from bitserve.sampling_params import SamplingParams
from bitserve.server.security.guard import RequestSecurity
from bitserve.server.security.middleware import SECURITY_STATE
from bitserve.server.security.principal import ANONYMOUS, Principal
from bitserve.server.security.rate_limits import token_specs


def request_security(request: Request) -> RequestSecurity | None:
    """What SecurityMiddleware found about this request (None for an app built without it)."""
    context: RequestSecurity | None = request.scope.get("state", {}).get(SECURITY_STATE)
    return context


def request_principal(request: Request) -> Principal:
    """The principal SecurityMiddleware found (ANONYMOUS for an app built without it)."""
    context = request_security(request)
    return context.principal if context is not None else ANONYMOUS


def token_cost(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    """The most a generation can use: its prompt plus max_tokens per choice (the rest of the context
    when max_tokens is unset)."""
    per_choice = params.max_tokens if params.max_tokens is not None else max_model_len - num_prompt_tokens
    return num_prompt_tokens + params.n * max(0, per_choice)


def _no_refund(num_used: int) -> None:
    return None


async def charge_tokens(context: RequestSecurity | None, cost: int) -> Callable[[int], None]:
    """Take `cost` tokens from the caller's token budgets (RateLimited when over), and return
    `settle(num_used)`, which gives back `cost - num_used` once (call it when the generation ends)."""
    if context is None or not token_specs(context.principal.limits):
        return _no_refund
    charged = await context.guard.limiter.charge(context.principal, cost)
    if charged.tokens is not None:
        context.rate.tokens = charged.tokens
    is_settled = False

    def settle(num_used: int) -> None:
        nonlocal is_settled
        if not is_settled:
            is_settled = True
            context.guard.refund_later(context.principal, cost - max(0, num_used))

    return settle
