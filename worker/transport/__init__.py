"""How steps reach a worker: ``actor`` (the Ray actor and ``create_worker``),
``compute_thread`` (every torch call of the actor on one thread), ``step_channel``
(steps and replies on a socket beside Ray calls) and ``protocol`` (the msgspec wire
format: step messages, replies and their codec). The only room of ``worker`` that
imports Ray."""
