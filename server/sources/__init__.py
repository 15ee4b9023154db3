"""Remote adapter sources (`s3://`, `https://` archives, `hf://`) behind the adapter source port
(`server.core.adapter_sources.AdapterFetcher`), with their local content-addressed cache."""
