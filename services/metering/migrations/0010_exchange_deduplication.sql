-- Captured exchanges, replay results and budget versions are inserted with an
-- insert_deduplication_token (their keys' values), as usage rows are: a batch
-- redelivered after a write whose outcome the writer could not see is dropped
-- at once, not left as duplicate rows until a merge collapses them. The token
-- only counts where a table remembers its recent blocks (webhook_calls has
-- since 0009).
ALTER TABLE exchanges MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE replays MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE budgets MODIFY SETTING non_replicated_deduplication_window = 1000;
