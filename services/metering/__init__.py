"""The metering service: usage events from JetStream into ClickHouse, exactly once."""
