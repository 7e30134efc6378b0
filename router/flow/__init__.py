"""A request's way through the router: ``flight`` (``RequestFlow`` and the ``Flight`` whose
``handle`` tells one request's story, parse to answer) and ``hold_queue`` (requests held while the pool
is saturated, bound late)."""
