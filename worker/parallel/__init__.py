"""Model parallelism: a model split over the ranks of a group (tensor and pipeline
parallel). ``layout`` says which layers and heads a rank holds, ``sharded_loader``
loads that shard, ``group`` runs the collectives, ``sharded_runner`` is a rank's
``ModelRunner``."""
