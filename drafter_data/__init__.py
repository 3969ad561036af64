"""Shared pieces of the drafter-data pipeline; the stages under stages/ import these, never the other way round."""
