"""The producers the router ships: precise block hashes, the shared-index refresh, and the other
replicas' in-flight reservations refreshed before the pick."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from jinja2.exceptions import TemplateError

from kvindex.chat_template import ChatTemplate
from kvindex.redis_index import SharedPrefixIndex
from kvindex.tokenize import PromptTokenizer, Tokenized
from router.request.types import RouteRequest
from router.state.pool import Pool
from router.state.shared_load import SharedLoad

log = logging.getLogger(__name__)


class PreciseKeys:
    """Precise mode: the prompt tokenized as the engine will, hashed into vLLM's block hashes.

    Chat requests are rendered with the model's chat template first and tokenized without added
    special tokens (the template writes BOS itself), as vLLM does. Without a template, chat
    requests get no precise keys: our own rendering would not match the engine's tokens, and the
    approximate index answers for them instead. A prompt given as token ids is hashed as it is
    (for a batch, the ids its prompts share: ``router.request.parse.token_prompt``), as vLLM takes it.
    """

    name = "precise_keys"
    fills = True

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        chat_template: ChatTemplate | None = None,
        chat_tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.chat_tokenizer = chat_tokenizer

    def wanted(self, request: RouteRequest) -> bool:
        return True  # every request's prompt is tokenized (token ids are taken as they are)

    async def produce(self, request: RouteRequest) -> None:
        if request.prompt_ids is not None:
            # Counted exactly at the parse (a batch: every prompt); a batch routes on shared ids.
            request.precise_keys = (await self.tokenizer.tokenize_ids(request.prompt_ids)).keys
            return
        tokenized = await self._tokenize(request)
        if tokenized is None:
            return
        request.precise_keys = tokenized.keys
        if request.prompts > 1:
            return  # the text the batch's prompts share, not their count: the estimate stays
        # The engine's own tokenizer counted them: an exact count, never rescaled by calibration.
        request.prompt_tokens = tokenized.tokens
        request.exact_tokens = True

    def close(self) -> None:
        """Stop the tokenizers' worker threads."""
        self.tokenizer.close()
        if self.chat_tokenizer is not None:
            self.chat_tokenizer.close()

    async def _tokenize(self, request: RouteRequest) -> Tokenized | None:
        messages = request.chat  # chat, Messages and Responses bodies alike, as the engine renders them
        if messages is None:
            return await self.tokenizer.tokenize(request.prompt) if request.prompt else None
        if self.chat_template is None or self.chat_tokenizer is None:
            return None
        try:
            text = self.chat_template.render(messages)
        except TemplateError as exc:
            log.debug("chat template failed for request %s: %s", request.request_id, exc)
            return None
        return await self.chat_tokenizer.tokenize(text)


class SharedLookup:
    """Refreshes the local mirror of the Redis-shared index with other replicas' entries for this
    prompt, in one round trip under the lookup timeout; on trouble the mirror answers alone, and
    while the replicas push their writes (``index.redis.push``) it has them already: no round trip."""

    name = "shared_lookup"
    fills = False

    def __init__(self, shared: SharedPrefixIndex, pool: Pool) -> None:
        self.shared = shared
        self.pool = pool

    def wanted(self, request: RouteRequest) -> bool:
        return len(request.block_keys) > 0 and not self.shared.pushed

    async def produce(self, request: RouteRequest) -> None:
        if len(request.block_keys):
            await self.shared.lookup(request.block_keys, self.pool.candidate_slots())


class FreshLoad:
    """The other replicas' in-flight reservations as of now rather than as of the last interval,
    within ``timeout_s`` (past it, or while Redis is down, the pick uses the last exchange's);
    nothing to wait for while they are pushed (``index.redis.push``) or there are none."""

    name = "shared_load"
    fills = False

    def __init__(self, shared_load: SharedLoad, timeout_s: float) -> None:
        self.shared_load = shared_load
        self.timeout_s = timeout_s

    def wanted(self, request: RouteRequest) -> bool:
        return not self.shared_load.current

    async def produce(self, request: RouteRequest) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.timeout_s):
                await self.shared_load.refresh()
