-- The operation each row's call was made on (chat.completions, completions,
-- embeddings, ...), from the usage event. Rows stored before this migration,
-- and events from routers that do not send it, read as an empty string: they
-- were chat or text completions. The rollups keep their keys: break usage
-- down by endpoint from usage_events.
ALTER TABLE usage_events
    ADD COLUMN IF NOT EXISTS endpoint LowCardinality(String) DEFAULT ''
        COMMENT 'The operation called: chat.completions, completions, embeddings, ...'
        AFTER priority;
