-- Remember the last 1,000 inserted blocks of each table, so that a block
-- inserted again with the same insert_deduplication_token (the writer's
-- retry after a failure whose outcome it could not see) is dropped in the
-- raw table and in each rollup alike. Replicated tables on a ClickHouse
-- cluster deduplicate by replicated_deduplication_window instead.
ALTER TABLE usage_events MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE usage_hourly MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE usage_daily MODIFY SETTING non_replicated_deduplication_window = 1000;
