"""The state a framework hands over, as ckptio sees it before any byte moves.

Pytrees flattened to named leaves (:mod:`.tree`), what kind each leaf is and the shards a host
holds (:mod:`.leaves`), leaves whose value is each host's own (:mod:`.perhost`), the dtypes a
manifest may name (:mod:`.dtypes`) and checked dtype changes (:mod:`.cast`). Nothing here knows
storage, manifests or hosts.
"""
