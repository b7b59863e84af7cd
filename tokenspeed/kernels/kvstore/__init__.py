"""Writing new K/V rows into the paged cache."""
