"""`bucketserve bench`: an online load generator with SLO attainment (issue 7)."""
