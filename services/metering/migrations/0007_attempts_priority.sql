-- Two columns from the usage event: how many times the request was queued
-- (the router queues it again, once, when its worker is lost before any
-- output) and its class. Rows stored before this migration, and events from
-- routers that do not send the fields yet, read as one attempt of an
-- interactive request. The rollups keep their keys: break usage down by
-- class from usage_events.
ALTER TABLE usage_events
    ADD COLUMN IF NOT EXISTS attempts UInt8 DEFAULT 1
        COMMENT 'Times it was queued: 2 when its first worker was lost before any output'
        AFTER http_status,
    ADD COLUMN IF NOT EXISTS priority LowCardinality(String) DEFAULT 'interactive'
        COMMENT 'Its class: interactive or batch'
        AFTER attempts;
