"""Models: the catalog, where weights come from (sources) and the prepared-model cache."""
