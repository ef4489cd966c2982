output "function_url" {
  description = "HTTPS endpoint of the gateway (pass it to `kvgate smoke --url` and to the client's `remote.url`)."
  value       = aws_lambda_function_url.this.function_url
}

output "function_name" {
  description = "Name of the gateway Lambda function."
  value       = aws_lambda_function.this.function_name
}

output "function_arn" {
  description = "ARN of the gateway Lambda function."
  value       = aws_lambda_function.this.arn
}

output "bucket_name" {
  description = "Name of the S3 bucket holding the KV chunk objects."
  value       = aws_s3_bucket.this.id
}

output "bucket_arn" {
  description = "ARN of the S3 bucket holding the KV chunk objects."
  value       = aws_s3_bucket.this.arn
}

output "role_arn" {
  description = "ARN of the function's IAM role (e.g. to grant it a KMS key managed elsewhere)."
  value       = aws_iam_role.this.arn
}

output "log_group_name" {
  description = "CloudWatch log group of the function."
  value       = aws_cloudwatch_log_group.this.name
}

output "auth_parameter_name" {
  description = "SSM parameter holding the token table; update it and the next cold start picks it up."
  value       = local.auth_parameter_name
}

output "staging_prefix" {
  description = "Bucket prefix where presigned uploads wait for their commit (expired by a lifecycle rule)."
  value       = local.staging_prefix
}
