"""What the scheduler asks of the KV tiers before it admits or restores a request.

Kept apart from the queue policy (scheduler.py) because it only reads the
cache: how many allocatable device pages a restore would take, and whether a
waiting prompt should wait for its disk pages to reach the host.
"""

from __future__ import annotations

from tokenspeed.kvcache import KVCache, Retraction, Tier
from tokenspeed.scheduler.request import Request


def restore_cost(kv: KVCache, retraction: Retraction) -> int:
    """An upper bound on the allocatable device pages `kv.restore(retraction)` takes.

    A page loaded from the host takes a new page; a page found on the device takes one
    only when nobody holds it (re-acquiring a cached page takes it out of the eviction
    order); a page another request holds costs nothing.
    """
    retraction.ensure_live()
    cost = 0
    for i in range(retraction.num_pages):
        page_hash = retraction.hashes[i] if i < len(retraction.hashes) else None
        page = None if page_hash is None or not kv.enable_prefix_caching else kv.index.lookup(page_hash)
        if page is None or kv.pool.refcount(page) == 0:
            cost += 1
    return cost


def blocked_on_disk(kv: KVCache, request: Request) -> bool:
    """The prompt's leading pages include a disk page still being read into the host tier.

    Admission passes such a request over for now (its prefetch was started on submit), so
    it matches the pages once they land instead of computing them again. Never a wedge: a
    read always completes (or fails, a miss), and a plan with nothing else to run waits for it.
    """
    if kv.disk is None or request.num_cached_tokens >= 0 or request.needs_prompt_logprobs:
        return False
    max_pages = (request.num_tokens - 1) // kv.page_size
    return any(not loc.ready and loc.tier is Tier.HOST for loc in kv.lookup(request.all_token_ids, max_pages))
