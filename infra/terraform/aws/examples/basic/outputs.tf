output "function_url" {
  description = "Gateway URL for `kvgate smoke --url` and the client's remote tier."
  value       = module.kvgate.function_url
}

output "bucket_name" {
  description = "Bucket holding the KV chunk objects."
  value       = module.kvgate.bucket_name
}
