"""The async controller: speculation, adoption, admission; the aiohttp service and client."""
